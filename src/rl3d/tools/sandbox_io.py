"""The caller's side of one sandbox run: feed stdin, drain stdout and stderr, watch the clock.

One loop in the calling thread (no reader threads to leak) over the pipes and a pidfd of the
launched process. It stops reading a short grace after that process exits even when something
it left behind still holds the pipes, so an orphan never makes the caller wait.
"""

from __future__ import annotations

import os
import selectors
import subprocess
import time
from dataclasses import dataclass, field

GRACE_SECONDS = 0.5  # reading on after the exit: output still in the pipes, then stop


@dataclass
class Capture:
    """The first (`keep="head"`) or last `limit` bytes of a stream, and how many it had."""

    limit: int
    keep: str
    data: bytearray = field(default_factory=bytearray)
    total: int = 0

    def add(self, chunk: bytes) -> None:
        self.total += len(chunk)
        if self.keep == "head":
            self.data += chunk[: max(self.limit - len(self.data), 0)]
        else:
            self.data = (self.data + chunk)[-self.limit :]

    def text(self) -> str:
        text = self.data.decode("utf-8", errors="replace")
        dropped = self.total - len(self.data)
        if not dropped:
            return text
        note = f"[... {dropped} bytes truncated]"
        return f"{text}\n{note}" if self.keep == "head" else f"{note}\n{text}"


def communicate(
    proc: subprocess.Popen, data: bytes, timeout: float, limit: int
) -> tuple[Capture, Capture, bool]:
    """Write `data` to the process's stdin, read its output until it exits (plus the grace) or
    `timeout` seconds pass; (stdout head, stderr tail, whether the timeout struck). The caller
    kills and reaps the process."""
    out, err = Capture(limit, "head"), Capture(limit, "tail")
    selector = selectors.DefaultSelector()
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    streams = {proc.stdout.fileno(): out, proc.stderr.fileno(): err}
    for fd in streams:
        selector.register(fd, selectors.EVENT_READ)
    stdin_fd, sent = proc.stdin.fileno(), 0
    os.set_blocking(stdin_fd, False)
    selector.register(stdin_fd, selectors.EVENT_WRITE)
    pidfd = os.pidfd_open(proc.pid)
    selector.register(pidfd, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    stop_at, timed_out = deadline, False
    try:
        while streams or stop_at == deadline:
            now = time.monotonic()
            if now >= stop_at:
                timed_out = stop_at == deadline
                break
            for key, _ in selector.select(stop_at - now):
                fd = key.fd
                if fd == pidfd:
                    selector.unregister(pidfd)
                    stop_at = min(stop_at, time.monotonic() + GRACE_SECONDS)
                elif fd == stdin_fd:
                    try:
                        sent += os.write(fd, data[sent : sent + 65536])
                    except BlockingIOError:
                        continue
                    except BrokenPipeError:
                        sent = len(data)  # it died before reading it all: its status says why
                    if sent >= len(data):
                        selector.unregister(fd)
                        proc.stdin.close()
                else:
                    chunk = os.read(fd, 65536)
                    if chunk:
                        streams[fd].add(chunk)
                    else:
                        selector.unregister(fd)
                        del streams[fd]
    finally:
        selector.close()
        os.close(pidfd)
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            stream.close()
    return out, err, timed_out
