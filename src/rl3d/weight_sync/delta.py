"""Delta weight updates: each bucket of a weight sync carries only the elements that changed
since the version the receiving rank holds (`rollout.weight_update: delta`).

In bf16 most weights do not move in a small-lr optimizer step (an update below half a unit in
the last place rounds away), so a sync can send far fewer bytes than the model. Per message (one
bucket of one route, as the pool plan cuts them) the sender compares the new bucket with the
one it last sent on that route, bit for bit (the elements' bit patterns: -0.0 differs from 0.0,
a NaN equals itself), and sends whichever encoding is smallest:
- `FULL`: the bucket as is (the first send, a repair, or when most elements changed);
- `BITMASK`: one bit per element, then the changed elements' values, in order;
- `INDEX`: the changed elements' positions (int32), then their values.
The receiver rebuilds the bucket from the one it holds plus the changes, so it holds exactly
the trainer's bits after every sync.

Versions make a missed update harmless: before each message the receiver tells the sender
which version it holds on that route (-1: none). The sender sends a delta only against the very
bucket the receiver holds; on any other answer (a restarted engine, an update the receiver never
applied, a restarted trainer) it sends the full bucket, which repairs the route. Each message is
three point-to-point exchanges (the version, an int64 header, the payload) through the sync's
`CountedComm`, so the bytes counted on the wire are the encodings' bytes plus 8 + 32 per message
(`DeltaCounts.wire_bytes`, checked on both sides).

Memory: the sender keeps the last bucket it sent on each of its routes, as many bytes as the
plan has it send per sync (`PoolTransition.plan.ranks[r].send_bytes`, the rank's shards times
the rollout engines it feeds, in the sync's dtype); the receiver keeps the buckets it holds (its
`bytes_to`), which the engine may share when it loads the tensors without a copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rl3d.hybrid_engine.comm import CountedComm, DeltaCounts

FULL, BITMASK, INDEX = 0, 1, 2
KIND_NAMES = {FULL: "full", BITMASK: "bitmask", INDEX: "index"}
HEADER_BYTES = 4 * 8  # int64: kind, changed elements, payload bytes, version
VERSION_BYTES = 8
_BIT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_BIT_WEIGHTS = (1, 2, 4, 8, 16, 32, 64, 128)


def encoding_bytes(numel: int, changed: int, element_size: int) -> dict[int, int]:
    """Payload bytes of each encoding of a bucket of `numel` elements, `changed` of them changed."""
    index = 4 if numel < 2**31 else 8
    return {
        FULL: numel * element_size,
        BITMASK: (numel + 7) // 8 + changed * element_size,
        INDEX: changed * (index + element_size),
    }


def choose(numel: int, changed: int, element_size: int) -> int:
    """The smallest encoding; FULL on a tie (no decoding), BITMASK before INDEX."""
    sizes = encoding_bytes(numel, changed, element_size)
    return min((FULL, BITMASK, INDEX), key=lambda kind: (sizes[kind], kind))


def changed_mask(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """Elements whose bits differ (flat, bool)."""
    assert new.shape == old.shape and new.dtype == old.dtype, (new.shape, old.shape, new.dtype, old.dtype)
    view = _BIT_VIEW[new.element_size()]
    return new.reshape(-1).view(view) != old.reshape(-1).view(view)


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """A flat bool mask as bytes, 8 elements a byte, least significant bit first."""
    pad = (-mask.numel()) % 8
    bits = torch.nn.functional.pad(mask.to(torch.uint8), (0, pad)).view(-1, 8)
    weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8, device=mask.device)
    return (bits * weights).sum(dim=1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, numel: int) -> torch.Tensor:
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(1) >> shifts) & 1).reshape(-1)[:numel].bool()


@dataclass(frozen=True)
class Encoded:
    kind: int
    changed: int  # elements that differ from the base (all of them for a first send)
    payload: torch.Tensor  # uint8


def encode(new: torch.Tensor, old: torch.Tensor | None) -> Encoded:
    """`new` (flat) against the bucket the receiver holds (`old`; None: it holds none)."""
    flat = new.reshape(-1)
    if old is None:
        return Encoded(FULL, flat.numel(), _bytes_of(flat))
    mask = changed_mask(flat, old)
    changed = int(mask.sum())
    kind = choose(flat.numel(), changed, flat.element_size())
    if kind == FULL:
        return Encoded(FULL, changed, _bytes_of(flat))
    values = _bytes_of(flat[mask])
    if kind == BITMASK:
        return Encoded(BITMASK, changed, torch.cat([pack_bits(mask), values]))
    positions = mask.nonzero().reshape(-1).to(torch.int32 if flat.numel() < 2**31 else torch.int64)
    return Encoded(INDEX, changed, torch.cat([_bytes_of(positions), values]))


def decode(
    kind: int, changed: int, payload: torch.Tensor, old: torch.Tensor | None, out: torch.Tensor
) -> None:
    """Write the bucket that `encode` made `payload` of into `out` (flat, the bucket's dtype)."""
    numel, size = out.numel(), out.element_size()
    if kind == FULL:
        out.view(torch.uint8).copy_(payload)
        return
    assert old is not None, "a delta needs the bucket it was made against"
    out.copy_(old)
    # copied out of the payload: a view across element sizes needs an aligned offset
    values = payload[payload.numel() - changed * size :].clone().view(out.dtype)
    if kind == BITMASK:
        out[unpack_bits(payload[: (numel + 7) // 8], numel)] = values
    else:
        index = torch.int32 if numel < 2**31 else torch.int64
        positions = payload[: payload.numel() - changed * size].clone().view(index).long()
        out[positions] = values


@dataclass
class _Held:
    version: int
    bucket: torch.Tensor


@dataclass
class _Counting:
    numel: int = 0
    changed: int = 0
    full_bytes: int = 0
    wire_bytes: int = 0
    kinds: dict[str, int] = field(default_factory=dict)

    def add(self, numel: int, enc_kind: int, changed: int, size: int, payload: int) -> None:
        self.numel += numel
        self.changed += changed
        self.full_bytes += numel * size
        self.wire_bytes += payload + HEADER_BYTES + VERSION_BYTES
        name = KIND_NAMES[enc_kind]
        self.kinds[name] = self.kinds.get(name, 0) + 1

    def counts(self) -> DeltaCounts:
        return DeltaCounts(self.numel, self.changed, self.full_bytes, self.wire_bytes, dict(self.kinds))


class DeltaSender:
    """A training rank's side: the last bucket sent on each route (receiver, bucket index)."""

    def __init__(self) -> None:
        self.version = -1  # the last sync's
        self.sent: dict[tuple[int, int], _Held] = {}
        self._count = _Counting()

    def begin(self) -> None:
        self.version += 1
        self._count = _Counting()

    def counts(self) -> DeltaCounts:
        return self._count.counts()

    @property
    def held_bytes(self) -> int:
        return sum(h.bucket.numel() * h.bucket.element_size() for h in self.sent.values())

    def exchange(self, comm: CountedComm, sends: dict[int, torch.Tensor], recvs: dict, tag: int) -> None:
        assert not recvs, "a training rank only sends in a weight sync"
        if not sends:
            return
        held = {dst: torch.empty(1, dtype=torch.int64, device=b.device) for dst, b in sends.items()}
        comm.exchange({}, held, tag=3 * tag)
        headers, payloads = {}, {}
        for dst, bucket in sends.items():
            base = self.sent.get((dst, tag))
            old = base.bucket if base is not None and base.version == int(held[dst].item()) else None
            enc = encode(bucket, old)
            n = enc.payload.numel()
            headers[dst] = torch.tensor([enc.kind, enc.changed, n, self.version], device=bucket.device)
            if n:
                payloads[dst] = enc.payload
            self.sent[(dst, tag)] = _Held(self.version, bucket)
            self._count.add(bucket.numel(), enc.kind, enc.changed, bucket.element_size(), n)
        comm.exchange(headers, {}, tag=3 * tag + 1)
        comm.exchange(payloads, {}, tag=3 * tag + 2)


class DeltaReceiver:
    """A rollout rank's side: the bucket it holds on each route (sender, bucket index)."""

    def __init__(self) -> None:
        self.held: dict[tuple[int, int], _Held] = {}
        self._count = _Counting()

    def begin(self) -> None:
        self._count = _Counting()

    def counts(self) -> DeltaCounts:
        return self._count.counts()

    def exchange(self, comm: CountedComm, sends: dict, recvs: dict[int, torch.Tensor], tag: int) -> None:
        assert not sends, "a rollout rank only receives in a weight sync"
        if not recvs:
            return
        versions = {}
        for src, bucket in recvs.items():
            have = self.held.get((src, tag))
            versions[src] = torch.tensor([-1 if have is None else have.version], device=bucket.device)
        comm.exchange(versions, {}, tag=3 * tag)
        headers = {src: torch.empty(4, dtype=torch.int64, device=b.device) for src, b in recvs.items()}
        comm.exchange({}, headers, tag=3 * tag + 1)
        meta = {src: [int(x) for x in h.tolist()] for src, h in headers.items()}
        payloads = {
            src: torch.empty(n, dtype=torch.uint8, device=recvs[src].device)
            for src, (_, _, n, _) in meta.items()
            if n
        }
        comm.exchange({}, payloads, tag=3 * tag + 2)
        for src, out in recvs.items():
            kind, changed, n, version = meta[src]
            have = self.held.get((src, tag))
            empty = torch.empty(0, dtype=torch.uint8, device=out.device)
            decode(kind, changed, payloads.get(src, empty), None if have is None else have.bucket, out)
            self.held[(src, tag)] = _Held(version, out)
            self._count.add(out.numel(), kind, changed, out.element_size(), n)
