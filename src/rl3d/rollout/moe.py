"""Mixture-of-experts layers and q/k norm in the torch engine: the parameter names and the MLP.

A MoE layer (megatron-core's MoELayer with SequentialMLP, Qwen3-MoE / Qwen2-MoE in HF) replaces
the dense `mlp.linear_fc1/fc2` with, after "decoder.layers.{i}.":

    mlp.router.weight                                     [E, h]     replicated
    mlp.experts.local_experts.{e}.linear_fc1.weight       [2 fe, h]  SwiGLU fc1 ([gate; up]), TP-split
    mlp.experts.local_experts.{e}.linear_fc2.weight       [h, fe]    row-parallel
    mlp.shared_experts.linear_fc1.weight / linear_fc2.weight          (Qwen2-MoE's, GLM's shared expert)
    mlp.shared_experts.gate_weight                        [1, h]     replicated, sigmoid gate (Qwen2-MoE)
    mlp.router.expert_bias                                [E] fp32   replicated (GLM-4.5)

`e` is the global expert index: under generation TP every rank holds every expert's TP slice, so
the experts' partial sums add up like the dense MLP's and one all-reduce completes the layer.
Qwen3's q/k norm adds `self_attention.{q,k}_layernorm.weight` [head_dim] (replicated).

The router runs in fp32 whatever the engine's dtype (as megatron's fp32 router and HF's softmax
do): logits, softmax, top-k (renormalised to sum 1 when `moe_norm_topk_prob`). GLM-4.5's sigmoid
router: sigmoid(logits), the top k of sigmoid + expert bias, their sigmoids renormalised (+1e-20,
as HF and megatron) and times `moe_routed_scaling`. Capacity-free:
every token gets its k experts. Each expert runs once over the tokens routed to it
(`index_select`, then `index_add_` of its weighted output), experts in ascending order.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import torch
import torch.nn.functional as F

from rl3d.models.params import (
    EXPERT_BIAS,
    EXPERT_FC1,
    EXPERT_FC2,
    ROUTER,
    SHARED_FC1,
    SHARED_FC2,
    SHARED_GATE,
    layer_param_name,
    megatron_params,
)
from rl3d.models.spec import ModelSpec


def engine_param_names(spec: ModelSpec) -> list[str]:
    """Every parameter the engine reads: the inventory's (`megatron_params`: a MoE layer's
    experts, router and shared expert in place of the dense MLP; q/k norms when the spec has them)."""
    return [p.name for p in megatron_params(spec)]


class MoEWeights(NamedTuple):
    """One MoE layer's pieces (each list: the generation-TP shard's training-TP pieces)."""

    router_fp32: torch.Tensor  # [E, h]
    fc1: list[list[torch.Tensor]]  # per expert
    fc2: list[list[torch.Tensor]]
    shared_fc1: list[torch.Tensor]  # empty without a shared expert
    shared_fc2: list[torch.Tensor]
    shared_gate: torch.Tensor | None  # [1, h]
    expert_bias_fp32: torch.Tensor | None = None  # [E]: the sigmoid router's correction bias


def moe_weights(pieces: Mapping[str, list[torch.Tensor]], spec: ModelSpec, layer: int) -> MoEWeights:
    def of(suffix: str) -> list[torch.Tensor]:
        return pieces.get(layer_param_name(layer, suffix), [])

    experts = range(spec.num_experts)
    gate, bias = of(SHARED_GATE), of(EXPERT_BIAS)
    return MoEWeights(
        router_fp32=of(ROUTER)[0].float(),  # a copy only when the engine is not fp32
        fc1=[of(EXPERT_FC1.format(e=e)) for e in experts],
        fc2=[of(EXPERT_FC2.format(e=e)) for e in experts],
        shared_fc1=of(SHARED_FC1),
        shared_fc2=of(SHARED_FC2),
        shared_gate=gate[0] if gate else None,
        expert_bias_fp32=bias[0].float() if bias else None,
    )


def swiglu(h: torch.Tensor, fc1: list[torch.Tensor], fc2: list[torch.Tensor]) -> torch.Tensor:
    """This rank's partial SwiGLU MLP output: piece i of fc2 consumes exactly fc1 piece i's
    activations ([gate_i; up_i]), so the pieces' products add up."""
    out = None
    for w1, w2 in zip(fc1, fc2):
        gate, up = F.linear(h, w1).chunk(2, dim=-1)
        part = F.linear(F.silu(gate) * up, w2)
        out = part if out is None else out + part
    return out


def route(h_NH: torch.Tensor, mw: MoEWeights, spec: ModelSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's choice per token: (weights [N, k] in h's dtype, expert ids [N, k] int64),
    ids in descending probability."""
    logits = F.linear(h_NH.float(), mw.router_fp32)
    if spec.moe_score_function == "sigmoid":
        scores = torch.sigmoid(logits)
        choice = scores if mw.expert_bias_fp32 is None else scores + mw.expert_bias_fp32
        if spec.moe_router_groups > 1:  # DeepSeek-V3: only the experts of the best groups
            choice = _best_groups(choice, spec)
        top_ids = torch.topk(choice, spec.moe_top_k, dim=-1).indices
        top_p = scores.gather(-1, top_ids)
        top_p = top_p / (top_p.sum(dim=-1, keepdim=True) + 1e-20) * spec.moe_routed_scaling
        return top_p.to(h_NH.dtype), top_ids
    probs = torch.softmax(logits, dim=-1)
    top_p, top_ids = torch.topk(probs, spec.moe_top_k, dim=-1)
    if spec.moe_norm_topk_prob:
        top_p = top_p / top_p.sum(dim=-1, keepdim=True)
    return top_p.to(h_NH.dtype), top_ids


def _best_groups(choice_NE: torch.Tensor, spec: ModelSpec) -> torch.Tensor:
    """`choice_NE` with -inf outside each token's `moe_router_group_topk` groups, a group ranked
    by the sum of its top_k / group_topk best choices (HF's and megatron's group-limited routing)."""
    N, G = choice_NE.shape[0], spec.moe_router_groups
    per_group = choice_NE.view(N, G, -1)
    score_NG = per_group.topk(spec.moe_top_k // spec.moe_router_group_topk, dim=-1).values.sum(-1)
    keep_NG = torch.zeros_like(score_NG, dtype=torch.bool)
    keep_NG.scatter_(1, score_NG.topk(spec.moe_router_group_topk, dim=-1).indices, True)
    return per_group.masked_fill(~keep_NG[..., None], float("-inf")).view(N, -1)


def moe_mlp(
    h_NH: torch.Tensor, mw: MoEWeights, spec: ModelSpec, record: list[torch.Tensor] | None = None
) -> torch.Tensor:
    """This rank's partial MoE layer output [N, h] for tokens `h_NH` (all-reduce it over the
    generation-TP group). `record`, when given, gets the layer's expert ids [N, k] appended."""
    top_w, top_ids = route(h_NH, mw, spec)
    if record is not None:
        record.append(top_ids)
    k = spec.moe_top_k
    flat = top_ids.flatten()  # token t's choices are entries [t k, t k + k)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=spec.num_experts).tolist()
    token_of = order // k
    x = h_NH.index_select(0, token_of)  # the routed copies of the tokens, grouped by expert
    parts, start = [], 0
    for e, count in enumerate(counts):
        if count:
            parts.append(swiglu(x[start : start + count], mw.fc1[e], mw.fc2[e]))
            start += count
    y = torch.cat(parts) if len(parts) > 1 else parts[0]
    # one accumulation in expert order, each token's outputs weighted by its router weights
    out = torch.zeros_like(h_NH).index_add_(0, token_of, y * top_w.flatten()[order, None])
    if mw.shared_fc1:
        shared = swiglu(h_NH, mw.shared_fc1, mw.shared_fc2)
        if mw.shared_gate is not None:
            shared = torch.sigmoid(F.linear(h_NH, mw.shared_gate)) * shared
        out = out + shared
    return out


def topk_set_mismatch(a: torch.Tensor, b: torch.Tensor) -> float:
    """The fraction of routing decisions (token, layer) whose expert sets differ between two
    records [tokens, layers, k] of the same tokens (order within a top-k set ignored)."""
    if a.shape != b.shape:
        raise ValueError(f"routing records of different shapes: {tuple(a.shape)} vs {tuple(b.shape)}")
    differ = (a.sort(dim=-1).values != b.sort(dim=-1).values).any(dim=-1)
    return differ.float().mean().item() if differ.numel() else 0.0
