"""The planner's view of the actor's parameters: segments, the pieces any layout holds whole.

The parameter inventory itself (`ParamInfo`, `model_params`, `stages_of`) is
`rl3d.models.params`'s, re-exported here. Each parameter is split into *segments*:
- a TP-sharded parameter has t segments (training TP shard i is segment i; generation TP
  shard a of t_g is segments a*r .. a*r+r-1);
- a replicated parameter (norms) is one segment;
- the fused QKV has t query blocks plus one segment per KV group, so that layouts with more
  TP ranks than KV heads (KV replicated, as vLLM/SGLang do) are planned exactly too.
"""

from __future__ import annotations

from rl3d.models.params import FIRST, LAST, ParamInfo, model_params, stages_of
from rl3d.parallel.sharding import ShardKind

__all__ = [
    "FIRST",
    "LAST",
    "ParamInfo",
    "SegmentTable",
    "check_shardable",
    "kv_groups_of",
    "model_params",
    "shard_shape",
    "stages_of",
]


def shard_shape(param: ParamInfo, tp: int) -> tuple[int, ...]:
    """The shape of one of `tp` TP shards of `param` (the whole shape when replicated)."""
    if param.kind is ShardKind.REPLICATED or tp == 1:
        return param.shape
    dim = param.kind.tp_dim
    return tuple(s // tp if i == dim else s for i, s in enumerate(param.shape))


def kv_groups_of(tp_rank: int, tp_size: int, num_groups: int) -> range:
    """KV groups held by a TP rank; when tp_size > num_groups each group is replicated."""
    if tp_size <= num_groups:
        per = num_groups // tp_size
        return range(tp_rank * per, (tp_rank + 1) * per)
    g = tp_rank * num_groups // tp_size
    return range(g, g + 1)


def check_shardable(param: ParamInfo, tp: int) -> None:
    """ValueError naming the parameter when it cannot be split over tp ranks."""

    def need(cond: bool, what: str) -> None:
        if not cond:
            raise ValueError(f"{param.name}: cannot shard over tp={tp}: {what}")

    if param.kind is ShardKind.REPLICATED:
        return
    if param.kind is ShardKind.QKV:
        nq, ng, _ = param.heads
        need(nq % tp == 0, f"{nq} attention heads not divisible by {tp}")
        need(ng % tp == 0 or tp % ng == 0, f"{ng} KV heads neither divisible by nor dividing {tp}")
    elif param.kind is ShardKind.SWIGLU_FC1:
        need(param.shape[0] % (2 * tp) == 0, f"ffn size {param.shape[0] // 2} not divisible by {tp}")
    else:
        dim = param.kind.tp_dim
        need(param.shape[dim] % tp == 0, f"dim {dim} of size {param.shape[dim]} not divisible by {tp}")


class SegmentTable:
    """Segment ids and sizes (elements) for a parameter list, cut for training TP size t."""

    def __init__(self, params: list[ParamInfo], t: int):
        self.t = t
        self.sizes: list[int] = []
        self._tp_segs: list[list[int]] = []  # per param: segments of the t TP blocks
        self._kv_segs: list[list[int]] = []  # per param (QKV): one segment per KV group
        for p in params:
            check_shardable(p, t)
            if p.kind is ShardKind.REPLICATED:
                self._tp_segs.append(self._new([p.numel]))
                self._kv_segs.append([])
            elif p.kind is ShardKind.QKV:
                nq, ng, hd = p.heads
                self._tp_segs.append(self._new([nq // t * hd * p.row_numel] * t))
                self._kv_segs.append(self._new([2 * hd * p.row_numel] * ng))
            else:
                self._tp_segs.append(self._new([p.numel // t] * t))
                self._kv_segs.append([])
        self.params = params

    def _new(self, sizes: list[int]) -> list[int]:
        start = len(self.sizes)
        self.sizes.extend(sizes)
        return list(range(start, start + len(sizes)))

    def shard(self, index: int, tp_rank: int, tp_size: int) -> list[int]:
        """Segments of TP shard `tp_rank` of `tp_size` (tp_size must divide t) of param `index`."""
        p = self.params[index]
        tp_segs = self._tp_segs[index]
        if p.kind is ShardKind.REPLICATED:
            return tp_segs
        r = self.t // tp_size
        segs = tp_segs[tp_rank * r : (tp_rank + 1) * r]
        if p.kind is ShardKind.QKV:
            segs = segs + [self._kv_segs[index][g] for g in kv_groups_of(tp_rank, tp_size, p.heads[1])]
        return segs

    def full(self, index: int) -> list[int]:
        return self._tp_segs[index] + self._kv_segs[index]

    def nbytes(self, segments, dtype_bytes: int) -> int:
        return sum(self.sizes[s] for s in segments) * dtype_bytes
