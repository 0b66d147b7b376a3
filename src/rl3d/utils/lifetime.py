"""Processes that end with the one that started them.

A run killed hard (`kill -9` of `rl3d train`, a scheduler's SIGKILL, an OOM kill) runs no
cleanup, so without help torchrun and its ranks outlive it: on a GPU an orphaned rank keeps its
memory and blocks the next job. Linux's parent-death signal (`prctl(PR_SET_PDEATHSIG)`) makes
the kernel kill a process when its parent ends, whatever the cause: `rl3d train` asks it for the
torchrun it starts (`die_with_parent` as its `preexec_fn`), and every rank torchrun starts asks
it for itself (`die_with_launcher`), so the chain goes down link by link. What a rank starts
in turn ends on its own: multiprocessing's resource tracker when its pipe closes, SGLang's
processes by their own parent watchdog. `tests/e2e/test_no_orphans.py` kills `rl3d train` and
finds no process of the run left.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1
TORCHRUN_ENV = "TORCHELASTIC_RUN_ID"  # set by torchrun in every rank it starts


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Have the kernel send `sig` to this process when its parent ends (Linux; a no-op
    elsewhere). A parent that ended before the call is seen through the changed parent pid."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG): {os.strerror(err)}")
    if os.getppid() != parent:  # the parent ended between the two reads
        os.kill(os.getpid(), sig)


def die_with_launcher() -> None:
    """In a rank that torchrun started: end with torchrun (see the module docstring)."""
    if TORCHRUN_ENV in os.environ:
        die_with_parent()
