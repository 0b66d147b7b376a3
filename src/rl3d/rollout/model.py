"""The decoder forward of the torch engine, computed straight from the generation shards.

A generation-TP shard arrives as `pieces`: the r = t/t_g consecutive training-TP shards it is
made of (one of them is the rank's own training tensor). They are never concatenated: every
sharded matmul runs piece by piece, which is exact because of how Megatron lays them out:
- linear_qkv (column-parallel, whole query groups per piece): per-piece outputs concatenate
  along the group axis into this rank's heads;
- linear_fc1 (piece i = [gate_i; up_i]): silu(gate_i) * up_i per piece, and linear_fc2
  (row-parallel) piece i consumes exactly that slice, so the partial products just add up;
- linear_proj (row-parallel): piece j consumes the heads of qkv piece j; partial products add;
- embedding / output layer (vocab-parallel): piece j covers a consecutive slice of the rank's
  vocabulary rows.
Partial sums of row-parallel layers and of the embedding lookup are all-reduced over the
generation-TP group. The math is Megatron's GPTModel (local spec) = HF Llama/Qwen2: RMSNorm,
rotate-half RoPE, GQA, SwiGLU; with Qwen3's RMSNorm over each query and key head before RoPE
(`spec.qk_norm`), mixture-of-experts MLPs (`rl3d.rollout.moe`), GLM-4.5's dense first layers
(`spec.is_moe_layer`) and partial RoPE (`spec.rotary_dim`: `rl3d.rollout.rope`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from rl3d.models.params import (
    EMBEDDING,
    EXPERT_BIAS,
    FC1_WEIGHT,
    FC2_WEIGHT,
    FINAL_NORM,
    INPUT_NORM,
    K_NORM,
    LAYER_PARAMS,
    MLP_NORM,
    OUTPUT_LAYER,
    PROJ_WEIGHT,
    Q_NORM,
    QKV_BIAS,
    QKV_WEIGHT,
    ROUTER,
    layer_param_name,
)
from rl3d.models.spec import ModelSpec
from rl3d.rollout.kv_cache import KVCache
from rl3d.rollout.mla import MLAWeights, mla_attention, mla_weights
from rl3d.rollout.moe import (
    MoEWeights,
    engine_param_names,
    moe_mlp,
    moe_weights,
)
from rl3d.rollout.rope import apply_rope

NEG_INF = float("-inf")


class TPComm:
    """The generation-TP group as the engine needs it; size 1 means no communication."""

    def __init__(self, group: Any = None):
        self.handle = getattr(group, "handle", group)
        self.device = torch.device("cpu")  # where small control tensors live (the weights' device)
        self.ranks = tuple(getattr(group, "ranks", ()))
        if group is None or not dist.is_initialized():
            self.size, self.rank = 1, 0
        elif self.handle is None:
            raise ValueError(f"this rank is not a member of the generation-TP group {self.ranks}")
        else:
            self.size = dist.get_world_size(self.handle)
            self.rank = dist.get_rank(self.handle)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.handle)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.handle)
        return torch.cat(parts, dim=-1)

    def agree(self, value: int) -> bool:
        """Whether every rank of the group passed the same integer (collective)."""
        if self.size == 1:
            return True
        t = torch.tensor([value, -value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.handle)
        return int(t[0]) == value == -int(t[1])

    def broadcast_int(self, value: int | None) -> int:
        """Group rank 0's value on every rank."""
        t = torch.tensor([value if value is not None else 0], dtype=torch.int64, device=self.device)
        if self.size > 1:
            src = dist.get_global_rank(self.handle, 0)
            dist.broadcast(t, src=src, group=self.handle)
        return int(t.item())


class LayerWeights(NamedTuple):
    """One decoder layer's pieces, looked up once instead of by name at every forward."""

    input_norm: torch.Tensor
    qkv: list[torch.Tensor]
    qkv_bias: list[torch.Tensor | None]
    proj: list[torch.Tensor]
    mlp_norm: torch.Tensor
    fc1: list[torch.Tensor]  # empty in a MoE layer
    fc2: list[torch.Tensor]
    qk_norm: tuple[torch.Tensor, torch.Tensor] | None = None  # q's and k's RMSNorm weight [head_dim]
    moe: MoEWeights | None = None
    lora: Any = None  # rl3d.rollout.lora_engine.LayerLora: adapters applied beside the base
    mla: MLAWeights | None = None  # DeepSeek-V3's multi-latent attention (qkv empty)


class DecodeLayer(NamedTuple):
    """One layer's pieces as the decode step uses them: transposed views ([in, out], no copy), so
    a 2-D matmul is one `mm` (what `F.linear` dispatches to) without `linear`/`t` on top."""

    qkv_t: list[torch.Tensor]
    proj_t: list[torch.Tensor]
    fc1_t: list[torch.Tensor]
    fc2_t: list[torch.Tensor]


@dataclass
class ShardedWeights:
    """Per parameter, the pieces of this rank's generation-TP shard (Megatron layout)."""

    spec: ModelSpec
    tp_size: int
    tp_rank: int
    pieces: dict[str, list[torch.Tensor]]
    lora: list[Any] | None = None  # per layer, adapters the forward applies (`LayerLora`)
    layers: list[LayerWeights] = field(default_factory=list, repr=False)
    decode_layers: list[DecodeLayer] = field(default_factory=list, repr=False)
    output_t: list[torch.Tensor] = field(default_factory=list, repr=False)

    @classmethod
    def from_generation(cls, weights: Any) -> ShardedWeights:
        """From the 3D-HybridEngine's `GenerationWeights` (pieces used in place). A whole-tensor
        (`full`) entry, which only the baseline strategies produce, is sliced to this rank's
        shard (a view, except SwiGLU fc1 which is one copy)."""
        if weights.released:
            raise RuntimeError("the generation weights were released; reshard before generating")
        from rl3d.ops.layouts import shard_for_tp

        pieces = {name: list(p) for name, p in weights.pieces.items()}
        for name, full in weights.full.items():
            kind = weights.params[name].kind
            pieces[name] = [shard_for_tp(full, kind, weights.gen_tp, weights.gen_tp_rank)]
        return cls(weights.spec, weights.gen_tp, weights.gen_tp_rank, pieces).checked()

    @classmethod
    def from_tensors(
        cls, spec: ModelSpec, tensors: Mapping[str, torch.Tensor], tp_size: int = 1, tp_rank: int = 0
    ) -> ShardedWeights:
        """From plain tensors: name -> this rank's Megatron generation-TP shard (one piece each)."""
        return cls(spec, tp_size, tp_rank, {n: [t] for n, t in tensors.items()}).checked()

    def cast(self, dtype: torch.dtype) -> ShardedWeights:
        """A copy in `dtype` (a rollout engine in lower precision than training); MoE routers
        and their expert bias are kept as they are (the router runs in fp32: no rounding of its
        weights to `dtype`)."""
        fp32 = (ROUTER, EXPERT_BIAS)
        pieces = {n: ps if n.endswith(fp32) else [p.to(dtype) for p in ps] for n, ps in self.pieces.items()}
        return ShardedWeights(self.spec, self.tp_size, self.tp_rank, pieces).checked()

    def checked(self) -> ShardedWeights:
        spec = self.spec
        needed = engine_param_names(spec)  # the actor's, tied output left out
        missing = [n for n in needed if n not in self.pieces]
        if missing:
            raise ValueError(
                f"torch rollout engine: weights lack {len(missing)} parameters, e.g. {missing[:3]} "
                "(pipeline-parallel generation, p_g > 1, is not supported by the torch engine)"
            )
        ffn = (
            (spec.moe_ffn_hidden_size, spec.shared_expert_ffn_hidden_size)
            if spec.is_moe
            else (spec.ffn_hidden_size,)
        )
        if spec.moe_first_dense_layers:
            ffn += (spec.ffn_hidden_size,)
        if (
            spec.num_query_groups % self.tp_size
            or any(f % self.tp_size for f in ffn)
            or (spec.is_mla and self.tp_size > 1)
        ):
            raise ValueError(f"torch rollout engine: {spec.name} cannot be split over t_g={self.tp_size}")
        rows = sum(p.shape[0] for p in self.pieces[EMBEDDING])
        if rows * self.tp_size < spec.vocab_size:
            raise ValueError(
                f"embedding shard has {rows} rows x t_g={self.tp_size} < vocab {spec.vocab_size}"
            )
        first = self.pieces[EMBEDDING][0]
        self.device, self.dtype = first.device, first.dtype
        self.layers = []
        for i in range(spec.num_layers):
            of = {p.suffix: self.pieces.get(layer_param_name(i, p.suffix)) for p in LAYER_PARAMS}
            qkv, fc1, fc2 = of[QKV_WEIGHT] or [], of[FC1_WEIGHT] or [], of[FC2_WEIGHT] or []
            assert len(fc1) == len(fc2), "fc2 piece i consumes fc1 piece i's activations"
            self.layers.append(
                LayerWeights(
                    input_norm=of[INPUT_NORM][0],
                    qkv=qkv,
                    qkv_bias=of[QKV_BIAS] or [None] * len(qkv),
                    proj=of[PROJ_WEIGHT],
                    mlp_norm=of[MLP_NORM][0],
                    fc1=[] if spec.is_moe_layer(i) else fc1,
                    fc2=[] if spec.is_moe_layer(i) else fc2,
                    qk_norm=(of[Q_NORM][0], of[K_NORM][0]) if spec.qk_norm else None,
                    moe=moe_weights(self.pieces, spec, i) if spec.is_moe_layer(i) else None,
                    lora=self.lora[i] if self.lora else None,
                    mla=mla_weights(self.pieces, spec, i) if spec.is_mla else None,
                )
            )
        self.decode_layers = [
            DecodeLayer(*([p.t() for p in ps] for ps in (lw.qkv, lw.proj, lw.fc1, lw.fc2)))
            for lw in self.layers
        ]
        self.output_t = [p.t() for p in self.output_pieces()]
        return self

    @property
    def vocab_rows(self) -> int:
        """Padded vocabulary rows per TP rank."""
        return sum(p.shape[0] for p in self.pieces[EMBEDDING])

    def output_pieces(self) -> list[torch.Tensor]:
        return self.pieces[EMBEDDING if self.spec.tied_embeddings else OUTPUT_LAYER]

    def kv_heads(self) -> int:
        """KV heads the cache holds per token: MLA's one latent, else this rank's query groups."""
        return 1 if self.spec.is_mla else self.spec.num_query_groups // self.tp_size


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    fp32 = x.dtype == torch.float32  # skip the no-op casts: one dispatch each, per norm
    h = x if fp32 else x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * (h if fp32 else h.to(x.dtype))


def causal_mask(key_valid_BL: torch.Tensor, start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, 1, T, end] additive mask (0 = attend, -inf = not) for queries at slots [start, end):
    causal, real tokens only; a padding query sees itself (no empty row). Additive in the
    query's dtype, as SDPA would convert a bool mask itself, once per layer."""
    q_pos = torch.arange(start, end, device=key_valid_BL.device)
    k_pos = torch.arange(end, device=key_valid_BL.device)
    mask = (k_pos <= q_pos[:, None]) & (key_valid_BL[:, None, :end] | (k_pos == q_pos[:, None]))
    return additive_mask(mask.unsqueeze(1), dtype)


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, NEG_INF)


def _vocab_embed(
    pieces: list[torch.Tensor], ids: torch.Tensor, rank_start: int, vocab_size: int
) -> torch.Tensor:
    if len(pieces) == 1 and rank_start == 0 and pieces[0].shape[0] >= vocab_size:
        return F.embedding(ids, pieces[0])  # one piece holds every id: no masking needed
    out, start = None, rank_start
    for w in pieces:
        rows = w.shape[0]
        local = ids - start
        hit = (local >= 0) & (local < rows)
        e = F.embedding(local.clamp(0, rows - 1), w) * hit.unsqueeze(-1).to(w.dtype)
        out = e if out is None else out + e
        start += rows
    return out


def embed_tokens(w: ShardedWeights, tokens: torch.Tensor, tp: TPComm) -> torch.Tensor:
    """The tokens' input embeddings, [..., hidden] (the vocab-parallel lookup, all-reduced)."""
    return tp.all_reduce(_vocab_embed(w.pieces[EMBEDDING], tokens, tp.rank * w.vocab_rows, w.spec.vocab_size))


def forward(
    w: ShardedWeights,
    tokens_BT: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    cache: KVCache,
    start: int,
    mask_B1TL: torch.Tensor,
    tp: TPComm,
    record: list[torch.Tensor] | None = None,
    embeds_BTH: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run T new tokens of B cached rows; writes their K/V at cache slots [start, start+T) and
    returns this rank's vocab-parallel logits of the last position, [B, vocab_rows].
    `rope` is `RopeTable.gather` at the tokens' positions, `mask_B1TL` an additive mask (`causal_mask`).
    `record` (MoE only), when given, gets each layer's expert ids [B*T, k] appended.
    `embeds_BTH`, when given, is the input in place of the tokens' embeddings (`embed_tokens`;
    a vision-language model's image positions replaced)."""
    spec = w.spec
    B, T = tokens_BT.shape
    end = start + T
    hd, hpg = spec.head_dim, spec.heads_per_group
    x = embed_tokens(w, tokens_BT, tp) if embeds_BTH is None else embeds_BTH
    cos, sin = rope
    for i, lw in enumerate(w.layers):
        h = rms_norm(x, lw.input_norm, spec.norm_eps)
        lo = lw.lora
        if lw.mla is not None:
            R = spec.rotary_dim
            attn = mla_attention(
                h, lw.mla, spec, cos[..., 0, 0, :R], sin[..., 0, 0, :R], cache, i, start, mask_B1TL
            )
        else:
            groups = [F.linear(h, wq, b).view(B, T, -1, hpg + 2, hd) for wq, b in zip(lw.qkv, lw.qkv_bias)]
            if lo is not None:
                groups = lo.add_qkv(h, groups)
            qkv = torch.cat(groups, dim=2) if len(groups) > 1 else groups[0]  # [B, T, G, hpg+2, hd]
            if lw.qk_norm is not None:
                qkv = _qk_norm(qkv, lw.qk_norm, spec.norm_eps)
            qk = apply_rope(
                qkv[:, :, :, : hpg + 1], cos, sin, spec.rotary_dim
            )  # queries and key of each group
            q = qk[:, :, :, :hpg].flatten(2, 3).transpose(1, 2)  # [B, H, T, hd]
            k = qk[:, :, :, hpg].transpose(1, 2)  # [B, G, T, hd]
            v = qkv[:, :, :, hpg + 1].transpose(1, 2)
            cache.write(i, k, v, start)
            # from slot 0 the cache holds exactly this k and v: use them (the cache's views have a
            # strided last dim, which would send SDPA to its slow math path)
            k_all, v_all = (k, v) if start == 0 else cache.read(i, B, end)
            attn = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask_B1TL, enable_gqa=True)
            attn = attn.transpose(1, 2).reshape(B, T, -1)  # [B, T, H*hd], heads in piece order
        proj = _row_parallel(attn, lw.proj)
        x = x + tp.all_reduce(proj if lo is None else lo.add_proj(attn, proj))
        h = rms_norm(x, lw.mlp_norm, spec.norm_eps)
        if lw.moe is not None:
            x = x + tp.all_reduce(moe_mlp(h.view(B * T, -1), lw.moe, spec, record).view(B, T, -1))
            continue
        if record is not None:  # a dense first layer routes nothing: its record is zeros
            record.append(torch.zeros(B * T, spec.moe_top_k, dtype=torch.int64, device=x.device))
        mlp = low = None
        ha = None if lo is None else lo.fc1_down(h)
        # piece j of fc2 consumes exactly piece j's activations
        for j, (fc1, fc2) in enumerate(zip(lw.fc1, lw.fc2)):
            gate_up = F.linear(h, fc1) if lo is None else lo.add_fc1(ha, F.linear(h, fc1), j)
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.silu(gate) * up
            part = F.linear(act, fc2)
            mlp = part if mlp is None else mlp + part
            if lo is not None:
                low = lo.fc2_down(low, act, j)
        x = x + tp.all_reduce(mlp if lo is None else lo.add_fc2(low, mlp))
    last = rms_norm(x[:, -1], w.pieces[FINAL_NORM][0], spec.norm_eps)
    logits = [F.linear(last, o) for o in w.output_pieces()]
    return torch.cat(logits, dim=-1) if len(logits) > 1 else logits[0]


def decode_forward(
    w: ShardedWeights,
    tokens_B: torch.Tensor,
    rope_B2RD: torch.Tensor,
    swap_index: torch.Tensor,
    cache: KVCache,
    slot: int,
    bias_N1L: torch.Tensor,
    tp: TPComm,
    record: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """`forward` for one new token per row (T = 1), with as few ops per layer as possible (on
    CPU, a small model's decode step is mostly per-op dispatch). Writes the tokens' K/V at cache
    slot `slot` and returns this rank's vocab-parallel logits, [B, vocab_rows].
    `rope_B2RD` is `RopeTable.decode_table` at the tokens' positions, `swap_index` the table's
    `swap_index` for this rank's qkv width, `bias_N1L` the additive mask per (row, kv head),
    [B * kv_heads, 1, slot + 1]."""
    spec = w.spec
    B = tokens_B.shape[0]
    hd, hpg = spec.head_dim, spec.heads_per_group
    x = tp.all_reduce(_vocab_embed(w.pieces[EMBEDDING], tokens_B, tp.rank * w.vocab_rows, spec.vocab_size))
    cos, sin = rope_B2RD[:, None, 0], rope_B2RD[:, None, 1]  # [B, 1, hpg+2, hd], broadcast over groups
    scale = hd**-0.5
    new_kv, keys_T, values = cache.step_views(B, slot)  # all layers' views, made once per step
    for i, (lw, lt) in enumerate(zip(w.layers, w.decode_layers)):
        h = _rms_norm_2d(x, lw.input_norm, spec.norm_eps)
        lo = lw.lora
        if lw.mla is not None:  # one token per row: T = 1, its mask [B, 1, 1, slot + 1]
            R, mask = spec.rotary_dim, bias_N1L.view(B, 1, 1, -1)
            cos_r, sin_r = rope_B2RD[:, None, 0, 0, :R], rope_B2RD[:, None, 1, 0, :R]
            attn = mla_attention(h[:, None], lw.mla, spec, cos_r, sin_r, cache, i, slot, mask).view(B, -1)
        else:
            groups = [_mm(h, wq, b) for wq, b in zip(lt.qkv_t, lw.qkv_bias)]
            if lo is not None:
                groups = lo.add_qkv(h, groups)
            qkv = (
                torch.cat(groups, dim=1) if len(groups) > 1 else groups[0]
            )  # [B, G*(hpg+2)*hd], whole groups
            if lw.qk_norm is not None:
                qkv = _qk_norm(qkv.view(B, -1, hpg + 2, hd), lw.qk_norm, spec.norm_eps).view(B, -1)
            # RoPE on queries and key (value: cos 1, sin 0)
            swapped = qkv.index_select(1, swap_index).view(B, -1, hpg + 2, hd)  # [x2, x1] per head
            qkv = torch.addcmul(qkv.view(B, -1, hpg + 2, hd) * cos, swapped, sin)  # [B, G, hpg+2, hd]
            new_kv[i] = qkv[:, :, hpg:]  # this token's K and V, one copy
            # the heads of a KV group are one batched matmul against that group's keys [B*G, hd, L]
            scores = torch.baddbmm(bias_N1L, qkv[:, :, :hpg].reshape(-1, hpg, hd), keys_T[i], alpha=scale)
            attn = torch.bmm(torch.softmax(scores, dim=-1), values[i]).view(B, -1)  # [B, H*hd], piece order
        proj = _row_parallel_t(attn, lt.proj_t)
        x = x + tp.all_reduce(proj if lo is None else lo.add_proj(attn, proj))
        h = _rms_norm_2d(x, lw.mlp_norm, spec.norm_eps)
        if lw.moe is not None:
            x = x + tp.all_reduce(moe_mlp(h, lw.moe, spec, record))
            continue
        if record is not None:  # a dense first layer routes nothing: its record is zeros
            record.append(torch.zeros(B, spec.moe_top_k, dtype=torch.int64, device=x.device))
        mlp = low = None
        ha = None if lo is None else lo.fc1_down(h)
        # piece j of fc2 consumes exactly piece j's activations
        for j, (fc1, fc2) in enumerate(zip(lt.fc1_t, lt.fc2_t)):
            gate_up, half = torch.mm(h, fc1), fc1.shape[1] // 2  # = chunk(2, dim=-1), one op less
            if lo is not None:
                gate_up = lo.add_fc1(ha, gate_up, j)
            act = F.silu(gate_up[:, :half]) * gate_up[:, half:]
            part = torch.mm(act, fc2)
            mlp = part if mlp is None else mlp + part
            if lo is not None:
                low = lo.fc2_down(low, act, j)
        x = x + tp.all_reduce(mlp if lo is None else lo.add_fc2(low, mlp))
    last = _rms_norm_2d(x, w.pieces[FINAL_NORM][0], spec.norm_eps)
    logits = [torch.mm(last, o) for o in w.output_t]
    return torch.cat(logits, dim=-1) if len(logits) > 1 else logits[0]


def _qk_norm(qkv: torch.Tensor, weights: tuple[torch.Tensor, torch.Tensor], eps: float) -> torch.Tensor:
    """Qwen3's RMSNorm over each query and key head of [..., hpg + 2, hd] (the value unchanged)."""
    hpg = qkv.shape[-2] - 2
    q = rms_norm(qkv[..., :hpg, :], weights[0], eps)
    k = rms_norm(qkv[..., hpg : hpg + 1, :], weights[1], eps)
    return torch.cat([q, k, qkv[..., hpg + 1 :, :]], dim=-2)


def _mm(x: torch.Tensor, w_t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, w_t.t(), bias)` for 2-D x, as F.linear computes it (addmm / mm)."""
    return torch.mm(x, w_t) if bias is None else torch.addmm(bias, x, w_t)


def _row_parallel_t(x: torch.Tensor, pieces_t: list[torch.Tensor]) -> torch.Tensor:
    """`_row_parallel` of 2-D x with transposed pieces."""
    if len(pieces_t) == 1:
        return torch.mm(x, pieces_t[0])
    out, col = None, 0
    for p in pieces_t:
        part = torch.mm(x[:, col : col + p.shape[0]], p)
        out = part if out is None else out + part
        col += p.shape[0]
    assert col == x.shape[-1], (col, x.shape)
    return out


def _rms_norm_2d(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`rms_norm` of [B, hidden] (fp32) with fewer, faster ops: mean(x^2) + eps as
    eps + |x|^2 / hidden from one fused vector norm (equal up to rounding)."""
    if x.dtype != torch.float32:
        return rms_norm(x, weight, eps)
    key = (eps, x.device)
    eps_t = _RMS_EPS.get(key)
    if eps_t is None:  # built once per eps and device
        _RMS_EPS[key] = eps_t = torch.tensor([eps], dtype=torch.float32, device=x.device)
    norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    return x * torch.addcmul(eps_t, norm, norm, value=1.0 / x.shape[-1]).rsqrt_() * weight


_RMS_EPS: dict[tuple[float, torch.device], torch.Tensor] = {}


def _row_parallel(x: torch.Tensor, pieces: list[torch.Tensor]) -> torch.Tensor:
    if len(pieces) == 1:
        return F.linear(x, pieces[0])
    out, col = None, 0
    for p in pieces:
        part = F.linear(x[..., col : col + p.shape[1]], p)
        out = part if out is None else out + part
        col += p.shape[1]
    assert col == x.shape[-1], (col, x.shape)
    return out
