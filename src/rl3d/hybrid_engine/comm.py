"""Counted collectives: every byte the executor moves is tallied here, and every failure or
timeout becomes a `ReshardError` that names the group and the ranks it waited for.

A phase of point-to-point transfers goes out as one batch (`batch_p2p`): NCCL progresses a
rank's concurrent sends and receives only when they are fused into one group, so a transfer
whose reverse is in the same phase, issued on its own, waits for the peer's receive while the
peer waits for ours, until the timeout. gloo moves both directions at once either way, which is
why only a GPU run would show it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from rl3d.parallel.groups import Group


class ReshardError(RuntimeError):
    """A transition failed: a collective timed out or a peer died, or verification failed."""


@dataclass
class CommCounter:
    recv_bytes: int = 0
    send_bytes: int = 0
    # calls this rank issued: a collective, a blocking send or receive, or one phase's batch of
    # point-to-point messages (`exchange`), however many messages it holds
    calls: int = 0
    # logical bytes received from each sender: with the nodes, the bytes each link carried
    recv_from: dict[int, int] = field(default_factory=dict)
    # messages received with bytes in them: one per sender and call (per tensor where a gather
    # sends its tensors unpacked, `Resharder.send_unpacked`)
    messages: int = 0

    def reset(self) -> None:
        self.recv_bytes = self.send_bytes = self.calls = self.messages = 0
        self.recv_from = {}

    def received(self, src: int, nbytes: int) -> None:
        self.recv_bytes += nbytes
        if nbytes:
            self.recv_from[src] = self.recv_from.get(src, 0) + nbytes
            self.messages += 1


@dataclass(frozen=True)
class DeltaCounts:
    """A weight sync sent as deltas (`rl3d.weight_sync.delta`), counted by its codec on one side:
    elements and changed elements, what the full buckets hold, the bytes on the wire (the
    encodings plus each message's version and header), and messages by encoding."""

    numel: int = 0
    changed: int = 0
    full_bytes: int = 0
    wire_bytes: int = 0
    kinds: dict[str, int] = field(default_factory=dict)

    def __add__(self, other: DeltaCounts) -> DeltaCounts:
        kinds = dict(self.kinds)
        for k, n in other.kinds.items():
            kinds[k] = kinds.get(k, 0) + n
        return DeltaCounts(
            self.numel + other.numel,
            self.changed + other.changed,
            self.full_bytes + other.full_bytes,
            self.wire_bytes + other.wire_bytes,
            kinds,
        )


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class CountedComm:
    """Logical byte counts: a rank receives each peer's chunk once and sends its own chunk once
    per receiver, whatever algorithm (ring, tree) the backend runs underneath."""

    def __init__(self, rank: int, timeout_s: float, *, bridge: dist.ProcessGroup | None = None):
        self.rank = rank
        self.timeout_s = timeout_s
        self.counter = CommCounter()
        # point to point over a process group outside the default world (two pools' ranks,
        # `rl3d.weight_sync.WeightBridge`): ranks are then its own
        self.bridge = bridge

    def _fail(self, op: str, group: Group, err: Exception) -> ReshardError:
        others = [r for r in group.ranks if r != self.rank]
        return ReshardError(
            f"rank {self.rank}: {op} over the {group.name} group {list(group.ranks)} did not complete "
            f"(waited for ranks {others}, timeout {self.timeout_s:g}s): {err}"
        )

    def all_gather_v(
        self, group: Group, chunks: dict[int, torch.Tensor | list[torch.Tensor]], async_op: bool = False
    ) -> list:
        """Member m's chunk goes to every member's `chunks[m]` (the sender's own entry is its
        input). With `async_op` the calls are only started: pass the returned works to `wait`.

        How depends on the group's backend (`gather_by_p2p`): on NCCL, equal sizes use one
        all-gather and unequal sizes one broadcast per sender; on gloo, one batch of
        point-to-point messages, each member's chunk sent straight into its peers' `chunks`
        entries (gloo's all-gather runs a ring through a staging buffer of its own and took 6x
        the time of the batch for 16 MB chunks on 4 ranks: docs/hybrid_engine.md). Only there
        may a chunk be a list of tensors, one message each: the sender's own tensors unpacked,
        the receivers' the matching consecutive views of their buffers."""
        parts = {m: c if isinstance(c, list) else [c] for m, c in chunks.items()}
        sizes = {m: sum(t.numel() for t in parts[m]) for m in group.ranks}
        mine = parts[self.rank]
        works = []
        try:
            if gather_by_p2p(group):
                others = [m for m in group.ranks if m != self.rank]
                sends = {m: mine for m in others} if sizes[self.rank] else {}
                recvs = {m: parts[m] for m in others if sizes[m]}
                if sends or recvs:
                    works.extend(batch_p2p(sends, recvs, tag=0))
                    self.counter.calls += 1
            elif any(isinstance(c, list) for c in chunks.values()):
                raise ValueError("all_gather_v: a chunk in pieces goes only point to point (gloo)")
            elif len(set(sizes.values())) == 1 and sizes[self.rank] > 0:
                works.append(
                    dist.all_gather(
                        [chunks[m] for m in group.ranks],
                        chunks[self.rank],
                        group=group.handle,
                        async_op=async_op,
                    )
                )
                self.counter.calls += 1
            else:
                for src in group.ranks:
                    if sizes[src]:
                        works.append(
                            dist.broadcast(chunks[src], src=src, group=group.handle, async_op=async_op)
                        )
                        self.counter.calls += 1
            if not async_op:
                for work in works:
                    if work is not None:
                        work.wait()
        except (RuntimeError, dist.DistBackendError) as err:
            raise self._fail("all-gather", group, err) from err
        for m in group.ranks:
            if m != self.rank:
                for piece in parts[m]:
                    self.counter.received(m, _nbytes(piece))
        self.counter.send_bytes += sum(_nbytes(t) for t in mine) * (group.size - 1)
        return works if async_op else []

    def wait(self, works: list, group: Group) -> None:
        try:
            for work in works:
                if work is not None:
                    work.wait()
        except (RuntimeError, dist.DistBackendError) as err:
            raise self._fail("all-gather", group, err) from err

    def broadcast(self, group: Group, tensor: torch.Tensor, src: int) -> None:
        try:
            dist.broadcast(tensor, src=src, group=group.handle)
            self.counter.calls += 1
        except (RuntimeError, dist.DistBackendError) as err:
            raise self._fail("broadcast", group, err) from err
        if src == self.rank:
            self.counter.send_bytes += _nbytes(tensor) * (group.size - 1)
        else:
            self.counter.received(src, _nbytes(tensor))

    # `send` and `recv` block, one message at a time: for transfers that all go one way (a
    # gather's members send, its root receives), where no message waits for its reverse.
    def send(self, group: Group, tensor: torch.Tensor, dst: int) -> None:
        try:
            dist.send(tensor, dst=dst, group=group.handle)
            self.counter.calls += 1
        except (RuntimeError, dist.DistBackendError) as err:
            raise self._fail(f"send to rank {dst}", group, err) from err
        self.counter.send_bytes += _nbytes(tensor)

    def recv(self, group: Group, tensor: torch.Tensor, src: int) -> None:
        try:
            dist.recv(tensor, src=src, group=group.handle)
            self.counter.calls += 1
        except (RuntimeError, dist.DistBackendError) as err:
            raise self._fail(f"receive from rank {src}", group, err) from err
        self.counter.received(src, _nbytes(tensor))

    def exchange(self, sends: dict[int, torch.Tensor], recvs: dict[int, torch.Tensor], tag: int = 0) -> None:
        """Point to point over the world (or the bridge), all at once: `sends[dst]` goes to rank
        dst, `recvs[src]` is filled from rank src (one message per pair and direction), in one
        batch that counts as one call."""
        if not sends and not recvs:
            return
        try:
            for work in batch_p2p(sends, recvs, tag=tag, bridge=self.bridge):
                work.wait()
            self.counter.calls += 1
        except (RuntimeError, dist.DistBackendError) as err:
            peers = sorted(set(sends) | set(recvs))
            raise ReshardError(
                f"rank {self.rank}: point-to-point exchange with ranks {peers} did not complete "
                f"(timeout {self.timeout_s:g}s): {err}"
            ) from err
        for src, t in recvs.items():
            self.counter.received(src, _nbytes(t))
        self.counter.send_bytes += sum(_nbytes(t) for t in sends.values())


def gather_by_p2p(group: Group) -> bool:
    """Whether `all_gather_v` over `group` goes as point-to-point messages: on gloo."""
    return dist.get_backend(group.handle) == dist.Backend.GLOO


def batch_p2p(
    sends: dict[int, torch.Tensor | list[torch.Tensor]],
    recvs: dict[int, torch.Tensor | list[torch.Tensor]],
    *,
    tag: int,
    bridge: dist.ProcessGroup | None = None,
) -> list:
    """Start one phase's sends and receives as one batch; returns the works to wait for.

    Over the world this is `torch.distributed.batch_isend_irecv`: one NCCL group on NCCL, the
    operations one by one on gloo, matched by `tag`. NCCL ignores tags; none are needed, since a
    batch holds at most one message per peer and direction (the dicts' keys) and a phase is
    waited for before the next one starts, so two ranks' messages pair up in the same order on
    both sides. A list under one peer is several messages to (or from) it, in list order, which
    both sides list alike. A bridge is a backend outside the default world, which a `P2POp` cannot name (it
    looks a group's ranks up in the world's registry): its batch is the same coalescing that
    `batch_isend_irecv` does, called on the backend itself."""
    recvs, sends = _messages(recvs), _messages(sends)
    if bridge is None:
        ops = [dist.P2POp(dist.irecv, t, src, tag=tag) for src, t in recvs]
        ops += [dist.P2POp(dist.isend, t, dst, tag=tag) for dst, t in sends]
        return dist.batch_isend_irecv(ops)
    fused = bridge.supports_coalescing  # NCCL: one group; gloo: one by one, by tag
    if fused:
        bridge._start_coalescing()
    works = [bridge.recv([t], src, tag) for src, t in recvs]
    works += [bridge.send([t], dst, tag) for dst, t in sends]
    if fused:
        works = [bridge._end_coalescing()]  # the operations inside a group return no work
    return [w for w in works if w is not None]


def _messages(by_peer: dict[int, torch.Tensor | list[torch.Tensor]]) -> list[tuple[int, torch.Tensor]]:
    """(peer, tensor) per message, in order."""
    return [
        (peer, t) for peer, ts in by_peer.items() for t in (ts if isinstance(ts, list) else [ts]) if t.numel()
    ]
