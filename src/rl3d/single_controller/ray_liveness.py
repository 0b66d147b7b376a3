"""The Ray driver's deadline on a lost node.

Ray marks a node dead only when its node health check gives up (about a minute with Ray's
defaults; `health_check_period_ms`, `health_check_failure_threshold` are settings of the
cluster's head, not of a job that joins it), and until then a call to an actor on that node
just waits. `RankActors(pool, node_timeout_s=launch.timeout_s)` records each rank actor's node
(hostname and IP, at actor start) and pings the actors the driver waits on, so a lost node ends
the job within `launch.timeout_s` (+ `PING_PERIOD_S`) with an error naming the node and ranks.
"""

from __future__ import annotations

import time
from typing import Any

# How often the driver pings the rank actors it waits on when a pool has a node deadline.
PING_PERIOD_S = 1.0


class Liveness:
    """The driver's deadline on lost nodes: while it waits on rank actors it pings them (a
    concurrency group of their own, so a busy rank still answers); a rank silent for
    `timeout_s` (`launch.timeout_s`) ends the wait with `WorkerDiedError` naming its node and
    the ranks on it. Ray itself notices a lost node only through its node health check (about
    a minute by default, a setting of the cluster, not of the job)."""

    GROUP = "liveness"

    def __init__(self, handles: list, nodes: list[str], timeout_s: float):
        self.handles, self.nodes, self.timeout_s = handles, nodes, timeout_s
        self.pings: dict[int, tuple[Any, float]] = {}  # rank -> (ping in flight, sent at)

    def check(self, ranks, *, role: str, what: str) -> None:
        """Ping `ranks` (one ping in flight per rank); raise if one was silent for timeout_s."""
        import ray

        now = time.monotonic()
        for rank in ranks:
            ref, _ = self.pings.get(rank, (None, now))
            if ref is None or ray.wait([ref], timeout=0)[0]:  # answered (a death: the call reports it)
                ping = self.handles[rank].where.options(concurrency_group=self.GROUP).remote()
                self.pings[rank] = (ping, now)
        self.raise_silent(ranks, self.timeout_s, role=role, what=what)

    def raise_silent(self, ranks, longer_than_s: float, *, role: str, what: str) -> None:
        """`WorkerDiedError` naming the node of the ranks whose ping is unanswered that long."""
        import ray

        from rl3d.single_controller.ray import WorkerDiedError

        now = time.monotonic()
        silent = [
            r
            for r in ranks
            if r in self.pings
            and now - self.pings[r][1] > longer_than_s
            and not ray.wait([self.pings[r][0]], timeout=0)[0]
        ]
        if not silent:
            return
        node = self.nodes[silent[0]]
        on_node = [r for r, n in enumerate(self.nodes) if n == node]
        quiet_s = now - self.pings[silent[0]][1]
        raise WorkerDiedError(
            f"{role} worker rank(s) {silent} on node {node} did not answer for {quiet_s:.0f} s during {what} "
            f"(launch.timeout_s {self.timeout_s:g}): node {node} is lost (ranks {on_node} run there)",
            role=role,
            rank=silent[0],
        )
