"""Distinct uids for concurrent sandbox runs, so that the kernel's per-uid quotas (inotify
instances and watches, epoll watches, pipe pages, POSIX message queue bytes, pending signals,
``RLIMIT_NPROC``) are per run: one run exhausting them leaves the others theirs.

A run leases one uid of ``user, user - 1, ..., user - user_pool + 1`` by taking an exclusive
`flock` on a lock file of that uid; the lock is the lease, across the threads of one trainer
and across trainers on one machine, and the kernel drops it should the holder die. A lone run
always gets ``user``. When every uid is leased the next run waits for one.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import time
from collections.abc import Iterator

LOCK_DIRS = ("/run/rl3d-sandbox-uids", "/tmp/rl3d-sandbox-uids")
POLL_SECONDS = 0.02


def _lock_dir() -> str:
    """A directory of this process's uid that no one else may write (a lock file another user
    could replace would be no lock)."""
    for path in LOCK_DIRS:
        try:
            os.makedirs(path, mode=0o700, exist_ok=True)
            info = os.lstat(path)
        except OSError:
            continue
        if stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid() and not info.st_mode & 0o022:
            return path
    raise RuntimeError(f"sandbox: no private directory for the uid leases ({', '.join(LOCK_DIRS)})")


@contextlib.contextmanager
def lease(first: int | None, pool: int) -> Iterator[int | None]:
    """The uid a run drops to, held until the block ends (None when the run drops to none)."""
    if first is None:
        yield None
        return
    directory = _lock_dir()
    uids = [first - i for i in range(pool)]
    while True:
        for uid in uids:
            fd = os.open(f"{directory}/{uid}", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            try:
                yield uid
            finally:
                os.close(fd)  # releases the lock
            return
        time.sleep(POLL_SECONDS)
