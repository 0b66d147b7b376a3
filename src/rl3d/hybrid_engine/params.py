"""The actor's parameter inventory, by shape only (no tensors): what the planner plans over.

Names are megatron-core GPTModel names with the global layer index. Each parameter is split
into *segments*, the smallest pieces any layout holds whole:
- a TP-sharded parameter has t segments (training TP shard i is segment i; generation TP
  shard a of t_g is segments a*r .. a*r+r-1);
- a replicated parameter (norms) is one segment;
- the fused QKV has t query blocks plus one segment per KV group, so that layouts with more
  TP ranks than KV heads (KV replicated, as vLLM/SGLang do) are planned exactly too.
"""

from __future__ import annotations

from dataclasses import dataclass

from rl3d.models.spec import ModelSpec
from rl3d.parallel.sharding import ShardKind, padded_vocab_size

FIRST, LAST = -1, -2  # pseudo layer indices: embedding stage, output stage


@dataclass(frozen=True)
class ParamInfo:
    """One Megatron parameter at t=1 (vocab padded for the training t)."""

    name: str
    kind: ShardKind
    shape: tuple[int, ...]
    layer: int  # global layer index, or FIRST / LAST
    tied_copy: bool = False  # output layer of a tied model: exists only when pipelined
    heads: tuple[int, int, int] | None = None  # QKV only: (num_heads, num_query_groups, head_dim)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def row_numel(self) -> int:
        return self.numel // self.shape[0]


def kv_groups_of(tp_rank: int, tp_size: int, num_groups: int) -> range:
    """KV groups held by a TP rank; when tp_size > num_groups each group is replicated."""
    if tp_size <= num_groups:
        per = num_groups // tp_size
        return range(tp_rank * per, (tp_rank + 1) * per)
    g = tp_rank * num_groups // tp_size
    return range(g, g + 1)


def model_params(spec: ModelSpec, *, train_tp: int) -> list[ParamInfo]:
    """Every parameter of the GPT model (Llama/Qwen2 family) in megatron-core's naming."""
    h, f, hd = spec.hidden_size, spec.ffn_hidden_size, spec.head_dim
    nq, ng = spec.num_attention_heads, spec.num_query_groups
    qkv_rows = (nq + 2 * ng) * hd
    vocab = padded_vocab_size(spec.vocab_size, train_tp)
    out = [ParamInfo("embedding.word_embeddings.weight", ShardKind.VOCAB, (vocab, h), FIRST)]
    for i in range(spec.num_layers):
        pre = f"decoder.layers.{i}."
        out += [
            ParamInfo(pre + "input_layernorm.weight", ShardKind.REPLICATED, (h,), i),
            ParamInfo(
                pre + "self_attention.linear_qkv.weight", ShardKind.QKV, (qkv_rows, h), i, heads=(nq, ng, hd)
            ),
        ]
        if spec.qkv_bias:
            out.append(
                ParamInfo(
                    pre + "self_attention.linear_qkv.bias", ShardKind.QKV, (qkv_rows,), i, heads=(nq, ng, hd)
                )
            )
        out += [
            ParamInfo(pre + "self_attention.linear_proj.weight", ShardKind.ROW, (h, nq * hd), i),
            ParamInfo(pre + "pre_mlp_layernorm.weight", ShardKind.REPLICATED, (h,), i),
            ParamInfo(pre + "mlp.linear_fc1.weight", ShardKind.SWIGLU_FC1, (2 * f, h), i),
            ParamInfo(pre + "mlp.linear_fc2.weight", ShardKind.ROW, (h, f), i),
        ]
    out.append(ParamInfo("decoder.final_layernorm.weight", ShardKind.REPLICATED, (h,), LAST))
    out.append(
        ParamInfo("output_layer.weight", ShardKind.VOCAB, (vocab, h), LAST, tied_copy=spec.tied_embeddings)
    )
    return out


def stages_of(param: ParamInfo, num_layers: int, pp: int) -> range:
    """Pipeline stages that hold `param` at pipeline size pp (layers split evenly)."""
    if param.layer == FIRST:
        return range(0, 1)
    if param.layer == LAST:
        # A tied output layer is the embedding itself unless the model is pipelined, in which
        # case megatron keeps a synced copy on the last stage.
        return range(0) if param.tied_copy and pp == 1 else range(pp - 1, pp)
    per = num_layers // pp
    return range(param.layer // per, param.layer // per + 1)


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
