"""torchrun, without its own failure report, and with a bound on how long it outlives a rank.

`python -m rl3d.launch.torchrun ARGS` is `torchrun ARGS`, except when a rank fails: every rank
already printed its one-line error (`rl3d.utils.failures.report_rank_failure`) and `rl3d train` names the
first, so torchrun's traceback and failure table (the launcher's, not the rank's) are left out;
the line left names this node and its failed ranks. The exit status is still non-zero.

On several nodes, torchrun polls the c10d rendezvous store between checks of its workers; when
the node that serves the store is gone (its link down, its processes killed), that poll blocks
and retries for minutes, long after this node's ranks failed on `launch.timeout_s`. A watchdog
thread notices a rank that exited with an error and stays unreaped for `STUCK_AFTER_S`, and
ends this torchrun (and its other ranks) with a line that says so.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time

STUCK_AFTER_S = 10.0  # torchrun reaps its workers every 0.1 s unless it is blocked


def _children() -> list[int]:
    pids: list[int] = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/children") as f:
                pids += [int(p) for p in f.read().split()]
        except OSError:
            continue
    return pids


def _rank_of(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        return env.get(b"RANK", b"?").decode()
    except OSError:
        return "?"


def _watch(stuck_after_s: float, poll_s: float = 0.5) -> None:
    """Exit the process when a worker failed and torchrun has not reaped it in time."""
    ranks: dict[int, str] = {}
    failed_at: dict[int, float] = {}
    while True:
        for pid in _children():
            ranks.setdefault(pid, _rank_of(pid))
        for pid in list(ranks):
            try:  # WNOWAIT: look at an exited child without reaping it (that is torchrun's job)
                info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:  # reaped: torchrun is alive and well
                ranks.pop(pid)
                failed_at.pop(pid, None)
                continue
            if info is not None and (info.si_code != os.CLD_EXITED or info.si_status != 0):
                failed_at.setdefault(pid, time.monotonic())
        stuck = [pid for pid, t in failed_at.items() if time.monotonic() - t > stuck_after_s]
        if stuck:
            failed = sorted(ranks[pid] for pid in stuck)
            print(  # noqa: T201
                f"torchrun on {socket.gethostname()}: rank(s) [{', '.join(failed)}] exited with an error; "
                f"torchrun is blocked (is the rendezvous store's node down?), stopping this node",
                file=sys.stderr,
                flush=True,
            )
            for pid in ranks:
                if pid not in failed_at:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            os._exit(1)
        time.sleep(poll_s)


def _write_exits(failures: dict) -> None:
    """Each failed rank's exit code, into `RL3D_RANK_EXITS` when `rl3d train` set it: a rank
    killed by a signal leaves no error line of its own, so the launcher names it from these."""
    path = os.environ.get("RL3D_RANK_EXITS")
    if path:
        import json

        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump({str(rank): failure.exitcode for rank, failure in failures.items()}, f)


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    if os.path.isdir("/proc/self/task"):
        threading.Thread(
            target=_watch, args=(STUCK_AFTER_S,), daemon=True, name="rl3d-torchrun-watch"
        ).start()
    try:
        run(parse_args(sys.argv[1:] if argv is None else argv))
    except ChildFailedError as err:
        _write_exits(err.failures)
        failed = sorted(err.failures)  # global ranks; the node names them on several nodes
        print(f"torchrun on {socket.gethostname()}: rank(s) {failed} exited with an error", file=sys.stderr)  # noqa: T201
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
