"""Run a plan's point-to-point phases: the one executor of `Transfer`s, whether the receivers
are ranks of the same world (the hierarchical gather) or another pool's (a rollout pool's
weight sync, over its bridge).

Phase k runs after phase k-1, one message per transfer with tag k; a transfer's pieces are
`(holder, parameter index)` training shards, packed in order. A sender packs its own shards and
whatever it received in an earlier phase (a relay); a receiver gets views into one buffer per
message. Every byte goes through a `CountedComm`, so what is counted is what the plan lists.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rl3d.hybrid_engine.comm import CountedComm
from rl3d.hybrid_engine.params import ParamInfo, shard_shape
from rl3d.hybrid_engine.plan import Transfer, piece_key
from rl3d.ops.layouts import ShardKind, merge_tp_shards, shard_for_tp
from rl3d.parallel.layout import ParallelLayout

Key = tuple[int, int]  # piece_key: (parameter index, holder's TP rank or -1 when replicated)


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
) -> tuple[dict[Key, torch.Tensor], list[torch.Tensor]]:
    """This rank's part (`comm.rank`) of every phase. `own`: its training shards by global name.
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
            assert t.unit == "shard", f"point-to-point phases move training shards, not {t.unit}"
            shapes = [shard_shape(params[i], train.t) for _, i in t.pieces]
            buf = torch.empty(sum(torch.Size(s).numel() for s in shapes), dtype=dtype, device=device)
            if t.src == me:
                tensors = [own[params[i].name] if h == me else got[key(h, i)] for h, i in t.pieces]
                pack_bucket(tensors, out=buf, backend=kernel_backend)
                sends[t.dst] = buf
            else:
                recvs[t.src] = buf
                landed.append((buf, t.pieces, shapes))
        comm.exchange(sends, recvs, tag=k)
        for buf, pieces, shapes in landed:
            cursor = 0
            for (h, i), shape in zip(pieces, shapes):
                n = torch.Size(shape).numel()
                got[key(h, i)] = buf[cursor : cursor + n].view(shape)
                cursor += n
            buffers.append(buf)
    return got, buffers


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
