"""Multi-latent attention (DeepSeek-V3) in the torch rollout engine, with its KV cache in the
compressed form: per token and layer the cache holds the normalised kv latent
(`kv_lora_rank`) and the one RoPE'd rope key all heads share (`qk_rope_head_dim`), not the
per-head keys and values; each forward expands the cached latents through `kv_b` (the kv up
projection) into keys and values. The engine's `KVCache` holds them as one KV head of width
latent + rope key, in its K half (its V half stays unused: 2x the latent's bytes, still
n_heads x (qk + v) / (2 (latent + rope)) = 35x less than the expanded keys and values at
DeepSeek-V3's shape).

RoPE as HF's `rope_interleave`: the rope channels are taken in (even, odd) pairs, i.e.
de-interleaved to [evens, odds], then rotated rotate-half style; q.k is the same for any order
applied to both, so the cache keeps the rotated key in that de-interleaved order.
Generation TP 1 only: a generation shard made of several training-TP pieces (training TP > 1)
gets each MLA projection's pieces concatenated once per weight update (one copy of the
attention weights).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from rl3d.models.params import KV_DOWN, KV_NORM, KV_UP, Q_DOWN, Q_NORM, Q_PROJ, Q_UP, layer_param_name


class MLAWeights(NamedTuple):
    q_down: torch.Tensor | None  # [rq, h] (None: one q projection)
    q_norm: torch.Tensor | None
    q_up: torch.Tensor  # [n qk, rq], or q_proj [n qk, h]
    kv_down: torch.Tensor  # [rkv + rope, h]
    kv_norm: torch.Tensor
    kv_up: torch.Tensor  # [n (nope + v), rkv]


def mla_weights(pieces: dict[str, list[torch.Tensor]], spec: Any, layer: int) -> MLAWeights:
    def one(suffix: str) -> torch.Tensor | None:
        got = pieces.get(layer_param_name(layer, suffix))
        if got is None:
            return None
        return got[0] if len(got) == 1 else torch.cat(got)  # training-TP pieces, column-parallel

    q_up = one(Q_UP) if spec.q_lora_rank else one(Q_PROJ)
    return MLAWeights(one(Q_DOWN), one(Q_NORM), q_up, one(KV_DOWN), one(KV_NORM), one(KV_UP))


def cache_width(spec: Any) -> int:
    """One cached token's width per layer: the kv latent and the shared rope key."""
    return spec.kv_lora_rank + spec.qk_rope_head_dim


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The engine's RMSNorm (`rl3d.rollout.model.rms_norm`, which imports this module)."""
    h = x.float()
    return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """HF's interleaved RoPE: [evens, odds], then x cos + rotate_half(x) sin (sin pre-signed)."""
    x = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
    half = x.shape[-1] // 2
    return x * cos + torch.cat([x[..., half:], x[..., :half]], dim=-1) * sin_signed


def mla_attention(
    h_BTH: torch.Tensor,
    mw: MLAWeights,
    spec: Any,
    cos_BTR: torch.Tensor,
    sin_BTR: torch.Tensor,
    cache: Any,
    layer: int,
    start: int,
    mask_B1TL: torch.Tensor,
) -> torch.Tensor:
    """T new tokens' attention output [B, T, n v] (before the output projection); writes their
    latents at cache slots [start, start + T). `cos_BTR` / `sin_BTR`: the rope channels' cos and
    signed sin (`RopeTable` rows) at the tokens' positions."""
    B, T, _ = h_BTH.shape
    n, qk, R, C = spec.num_attention_heads, spec.head_dim, spec.qk_rope_head_dim, spec.kv_lora_rank
    if mw.q_down is not None:
        q = F.linear(rms_norm(F.linear(h_BTH, mw.q_down), mw.q_norm, spec.norm_eps), mw.q_up)
    else:
        q = F.linear(h_BTH, mw.q_up)
    q_nope, q_rope = q.view(B, T, n, qk).split([qk - R, R], dim=-1)
    latent, k_rope = F.linear(h_BTH, mw.kv_down).split([C, R], dim=-1)
    new = torch.cat([rms_norm(latent, mw.kv_norm, spec.norm_eps), _rope(k_rope, cos_BTR, sin_BTR)], dim=-1)
    end = start + T
    cache.k[layer, :B, 0, start:end] = new
    cached = new if start == 0 else cache.k[layer, :B, 0, :end]  # [B, L, C + R]
    L = cached.shape[1]
    k_nope, v = F.linear(cached[..., :C], mw.kv_up).view(B, L, n, -1).split([qk - R, spec.v_head_dim], dim=-1)
    k = torch.cat([k_nope, cached[..., None, C:].expand(B, L, n, R)], dim=-1)
    q = torch.cat([q_nope, _rope(q_rope, cos_BTR[:, :, None], sin_BTR[:, :, None])], dim=-1)
    attn = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask_B1TL, scale=qk**-0.5
    )
    return attn.transpose(1, 2).reshape(B, T, n * spec.v_head_dim)
