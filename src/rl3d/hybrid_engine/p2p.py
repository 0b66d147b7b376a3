"""Run a plan's point-to-point phases: the one executor of `Transfer`s, whether the receivers
are ranks of the same world (the hierarchical gather) or another pool's (a rollout pool's
weight sync, over its bridge).

Phase k runs after phase k-1, as one batch (`comm.batch_p2p`) of one message per transfer
with tag k; a transfer's pieces are `(holder, parameter index)` training shards, packed in
order, or (`unit="slice"`) the parts of an expert's training shard that the receiver generates
with (`plan.slice_parts`). A sender packs its own shards and whatever it received in an
earlier phase (a relay); a receiver gets views into one buffer per message. Every byte goes
through a `CountedComm`, so what is counted is what the plan lists.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from rl3d.hybrid_engine.comm import CountedComm
from rl3d.hybrid_engine.params import ParamInfo, shard_shape
from rl3d.hybrid_engine.plan import Transfer, expert_parts, piece_key, slice_parts
from rl3d.ops.layouts import ShardKind, merge_tp_shards, shard_for_tp
from rl3d.parallel.layout import GenerationLayout, ParallelLayout

# piece_key: (parameter index, holder's TP rank or -1 when replicated), or (index, part) of a slice
Key = tuple[int, int]


def run_phases(
    phases: Sequence[Sequence[Transfer]],
    *,
    comm: CountedComm,
    params: Sequence[ParamInfo],
    train: ParallelLayout,
    own: dict[str, torch.Tensor],
    dtype: torch.dtype,
    device: torch.device,
    kernel_backend: str | None = None,
    gen: GenerationLayout | None = None,
    exchange: Callable[[CountedComm, dict, dict, int], None] | None = None,
) -> tuple[dict[Key, torch.Tensor], list[torch.Tensor]]:
    """This rank's part (`comm.rank`) of every phase. `own`: its training shards by global name;
    `gen`: the generation layout the ranks of the world take (slices only); `exchange(comm,
    sends, recvs, k)`: moves a phase's packed buckets in place of `comm.exchange` (a weight
    sync's delta encoding, `rl3d.weight_sync.delta`), filling the same receive buffers.
    Returns what it received, by piece key, and the buffers holding it."""
    from rl3d.ops import pack_bucket

    me = comm.rank
    got: dict[Key, torch.Tensor] = {}
    buffers: list[torch.Tensor] = []

    def key(holder: int, i: int) -> Key:
        return piece_key(i, params[i].kind is ShardKind.REPLICATED, train.coords(holder).tp)

    for k, phase in enumerate(phases):
        sends, recvs, landed = {}, {}, []
        for t in phase:
            if me not in (t.src, t.dst):
                continue
            if t.unit == "slice":
                assert gen is not None, "slices are cut for a generation layout"
                keys, shapes, tensors = _slices(t, params, gen, own if t.src == me else None)
            else:
                assert t.unit == "shard", f"point-to-point phases move training shards, not {t.unit}"
                keys = [key(h, i) for h, i in t.pieces]
                shapes = [shard_shape(params[i], train.t) for _, i in t.pieces]
                if t.src == me:
                    tensors = [own[params[i].name] if h == me else got[key(h, i)] for h, i in t.pieces]
            buf = torch.empty(sum(torch.Size(s).numel() for s in shapes), dtype=dtype, device=device)
            if t.src == me:
                pack_bucket(tensors, out=buf, backend=kernel_backend)
                sends[t.dst] = buf
            else:
                recvs[t.src] = buf
                landed.append((buf, keys, shapes))
        if exchange is None:
            comm.exchange(sends, recvs, tag=k)
        else:
            exchange(comm, sends, recvs, k)
        for buf, keys, shapes in landed:
            cursor = 0
            for piece, shape in zip(keys, shapes):
                n = torch.Size(shape).numel()
                got[piece] = buf[cursor : cursor + n].view(shape)
                cursor += n
            buffers.append(buf)
    return got, buffers


def _slices(t: Transfer, params: Sequence[ParamInfo], gen: GenerationLayout, own: dict | None):
    """(keys, shapes, tensors) of a slice transfer's parts, in order; tensors are cut from the
    holder's own expert shards (None on the receiver)."""
    train = gen.train
    n = expert_parts(train, gen.t_g)
    per = n // train.expert_t  # parts of one training shard
    keys, shapes, tensors = [], [], []
    for h, i in t.pieces:
        assert h == t.src, "a slice is sent by its holder"
        etp = train.coords(h).etp
        for q in slice_parts(train, gen.t_g, etp, gen.coords(t.dst).tp_g):
            keys.append((i, q))
            shapes.append(shard_shape(params[i], n))
            if own is not None:
                tensors.append(shard_for_tp(own[params[i].name], params[i].kind, per, q - etp * per))
    return keys, shapes, tensors if own is not None else None


def generation_shards(
    got: dict[Key, torch.Tensor], params: Sequence[ParamInfo], *, train_tp: int, gen_tp: int, gen_tp_rank: int
) -> dict[str, torch.Tensor]:
    """A rollout rank's generation-TP shard of every parameter it received, in parameter
    order: the training shards merged in TP order, then cut when t_g > t."""
    by_index: dict[int, dict[int, torch.Tensor]] = {}
    for (i, tp), tensor in got.items():
        by_index.setdefault(i, {})[tp] = tensor
    out = {}
    for i in sorted(by_index):
        p, shards = params[i], by_index[i]
        merged = merge_tp_shards([shards[tp] for tp in sorted(shards)], p.kind)
        if gen_tp > train_tp:
            k = gen_tp // train_tp
            merged = shard_for_tp(merged, p.kind, k, gen_tp_rank % k)
        out[p.name] = merged
    return out
