"""Processes that end with the one that started them.

A run killed hard (`kill -9` of `rl3d train`, a scheduler's SIGKILL, an OOM kill) runs no
cleanup, so without help torchrun and its ranks outlive it: on a GPU an orphaned rank keeps its
memory and blocks the next job. Linux's parent-death signal (`prctl(PR_SET_PDEATHSIG)`) makes
the kernel kill a process when its parent ends, whatever the cause: `rl3d train` asks it for the
torchrun it starts (`die_with_parent` as its `preexec_fn`), and every rank torchrun starts asks
it for itself (`die_with_launcher`), so the chain goes down link by link. A multiprocessing
spawn child of a rank (megatron-core's checkpoint writer starts a `Manager` server on the first
save, and it would otherwise outlive the rank for good) imports the rank's main module as
`__mp_main__` before it runs anything else; that module calls `die_with_rank_if_spawned`, so
the child asks the signal for itself too. Multiprocessing's resource tracker ends on its own
when the last process holding its pipe is gone, SGLang's processes by their own parent watchdog.
`tests/e2e/test_no_orphans.py` kills `rl3d train`, before and after a checkpoint, and finds no
process of the run left.
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


def die_with_rank_if_spawned(module_name: str) -> None:
    """Call at the top level of a rank's main module with its `__name__`: in a multiprocessing
    spawn child of the rank (which imports that module as `__mp_main__`) end with the rank."""
    if module_name == "__mp_main__":
        die_with_launcher()
