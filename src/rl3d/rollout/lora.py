"""LoRA adapters as the rollout engines receive them, in Megatron's layout.

Adapters cross every boundary as PEFT saves them for the HF model (`save_pretrained`'s
adapter_model.safetensors and adapter_config.json): whole (t=1) tensors named
`base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight` [r, in] and
`...lora_B.weight` [out, r], with r, lora_alpha (scaling = alpha / r, or alpha / sqrt(r) with
rsLoRA) in the config. Targets: q_proj k_proj v_proj o_proj gate_proj up_proj down_proj.

Here they become one low-rank pair per Megatron parameter, delta W = b @ a with the scaling
folded into b: the fused QKV stacks the q, k and v factors (a = [A_q; A_k; A_v], b = each
module's B in its own columns, rows interleaved per query group as the base is), the fused
SwiGLU fc1 likewise ([gate; up]). Sharding follows the base layer: column-parallel QKV and fc1
split b's rows exactly as the base's rows are split; row-parallel linear_proj and linear_fc2
split a's input columns, so the partial products add up over the TP group as the base's do.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from rl3d.models.lora_names import ALL_LINEAR, FUSED, TARGETS, peft_key, resolve_targets, scaling_of
from rl3d.models.lora_shapes import factor_shapes
from rl3d.models.params import FC1_WEIGHT, FC2_WEIGHT, PROJ_WEIGHT, QKV_WEIGHT, layer_param_name
from rl3d.models.spec import ModelSpec
from rl3d.ops.layouts import ShardKind, fc1_hf_to_megatron, qkv_hf_to_megatron, shard_for_tp

LORA_TARGETS = tuple(TARGETS)  # q_proj k_proj v_proj o_proj gate_proj up_proj down_proj
PARAM_KINDS = {  # the adapted Megatron layer parameters and how TP splits them
    QKV_WEIGHT: ShardKind.QKV,
    PROJ_WEIGHT: ShardKind.ROW,
    FC1_WEIGHT: ShardKind.SWIGLU_FC1,
    FC2_WEIGHT: ShardKind.ROW,
}
PEFT_NAME = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$"
)


def param_suffix(module: str) -> str:
    """The Megatron layer parameter (after "decoder.layers.{i}.") that `module` adapts."""
    return TARGETS[module].linear + ".weight"


@dataclass(frozen=True)
class AdapterConfig:
    """What the engines need of a PEFT `LoraConfig` / adapter_config.json."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    use_rslora: bool = False

    @property
    def scaling(self) -> float:
        return scaling_of(self.rank, self.alpha, self.use_rslora)

    @classmethod
    def from_peft(cls, config: Any) -> AdapterConfig:
        """From a PEFT `LoraConfig`, the dict of adapter_config.json, `actor.lora`'s config
        (`rl3d.config.lora.LoraConfig`), or an AdapterConfig."""
        if isinstance(config, AdapterConfig):
            return config
        if hasattr(config, "rank") and hasattr(config, "targets"):  # actor.lora
            return cls(config.rank, float(config.alpha), config.targets, config.use_rslora)
        get = config.get if isinstance(config, Mapping) else lambda k, d=None: getattr(config, k, d)
        for key in ("rank_pattern", "alpha_pattern"):
            if get(key):
                raise ValueError(f"LoRA adapter config: {key} (per-module ranks) is not supported")
        if get("use_dora"):
            raise ValueError("LoRA adapter config: use_dora (DoRA) is not supported")
        if get("bias", "none") != "none":
            raise ValueError(f"LoRA adapter config: bias={get('bias')!r} is not supported (only 'none')")
        targets = get("target_modules") or ()
        targets = (targets,) if isinstance(targets, str) else tuple(targets)
        unknown = [t for t in targets if t not in LORA_TARGETS and t != ALL_LINEAR]
        if unknown:
            raise ValueError(
                f"LoRA adapter config: target_modules {unknown} unknown; known: {list(LORA_TARGETS)}"
            )
        rank = get("r")
        if not isinstance(rank, int) or rank < 1:
            raise ValueError(f"LoRA adapter config: r must be a positive integer, got {rank!r}")
        alpha = float(get("lora_alpha", rank))
        return cls(rank, alpha, resolve_targets(targets), bool(get("use_rslora", False)))


@dataclass(frozen=True)
class LowRank:
    """One Megatron parameter's adapter: delta W = b @ a, a [k, in], b [out, k] (scaled)."""

    name: str
    kind: ShardKind
    a: torch.Tensor
    b: torch.Tensor
    shard: tuple[int, int] = (0, 1)  # (index, count): TP shard of the whole the factors are

    def delta(self) -> torch.Tensor:
        return self.b @ self.a

    def piece(self, tp_size: int, tp_rank: int, num_pieces: int, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(a, b) of piece j of generation-TP shard `tp_rank` of `tp_size` made of `num_pieces`
        training shards: piece j is training shard tp_rank * num_pieces + j of t_g * num_pieces."""
        held, count = self.shard
        assert tp_size % count == 0, (self.shard, tp_size)
        per = tp_size * num_pieces // count  # pieces of the whole in the shard held here
        index = tp_rank * num_pieces + j - held * per
        assert 0 <= index < per, f"piece {j} of rank {tp_rank}/{tp_size} is outside shard {self.shard}"
        if self.kind is ShardKind.ROW:
            return shard_for_tp(self.a, self.kind, per, index), self.b
        return self.a, shard_for_tp(self.b, self.kind, per, index)


def parse_adapters(
    spec: ModelSpec, tensors: Mapping[str, torch.Tensor], config: Any, num_shards: int = 1
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """(layer, module) -> (A [r, in], B [out, r]) from PEFT's saved tensors (or their TP shards
    of `num_shards`, as the adapter transition delivers them), checked against `spec`."""
    config = AdapterConfig.from_peft(config)
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        m = PEFT_NAME.match(name)
        if m is None or m.group(2) not in LORA_TARGETS:
            raise ValueError(
                f"LoRA adapter tensor {name!r} is not a PEFT lora_A/lora_B of {list(LORA_TARGETS)}"
            )
        layer, module, factor = int(m.group(1)), m.group(2), m.group(3)
        if layer >= spec.num_layers:
            raise ValueError(f"LoRA adapter tensor {name!r}: {spec.name} has {spec.num_layers} layers")
        found.setdefault((layer, module), {})[factor] = t
    out = {}
    for (layer, module), ab in sorted(found.items()):
        if set(ab) != {"A", "B"}:
            raise ValueError(f"LoRA adapter: {module} of layer {layer} has lora_{''.join(ab)} only")
        shape_a, shape_b = factor_shapes(spec, module, config.rank, num_shards)
        a, b = ab["A"], ab["B"]
        if a.shape != shape_a or b.shape != shape_b:
            raise ValueError(
                f"LoRA adapter {peft_key(layer, module, 'A')}: A {tuple(a.shape)}, B {tuple(b.shape)}; "
                f"expected A {shape_a}, B {shape_b} for r={config.rank}"
                + (f" (TP shards of {num_shards})" if num_shards > 1 else "")
            )
        out[(layer, module)] = (a, b)
    return out


def megatron_low_rank(
    spec: ModelSpec, tensors: Mapping[str, torch.Tensor], config: Any, shard: tuple[int, int] = (0, 1)
) -> dict[str, LowRank]:
    """Global Megatron parameter name -> its adapter as one (fused) low-rank pair. `tensors` are
    whole, or TP shard `shard` = (index, count) of each factor (a generation rank's, from the
    adapter transition): the fused pair is then that TP shard of the whole one."""
    scaling = AdapterConfig.from_peft(config).scaling
    adapters = parse_adapters(spec, tensors, config, num_shards=shard[1])
    by_param: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
    for (layer, module), ab in adapters.items():
        by_param.setdefault(layer_param_name(layer, param_suffix(module)), {})[module] = ab
    out = {}
    for name, modules in by_param.items():
        suffix = name.split(".", 3)[3]
        kind = PARAM_KINDS[suffix]
        # the fused parameter's modules in their fused order; absent ones get zero rows
        order = FUSED[suffix.removesuffix(".weight")]
        present = [m for m in order if m in modules]
        a = torch.cat([modules[m][0] for m in present], dim=0)
        k, cols, parts = a.shape[0], 0, []
        for m in order:
            b_m = modules[m][1] if m in modules else None
            rows = factor_shapes(spec, m, 1, shard[1])[1][0]
            wide = a.new_zeros(rows, k)
            if b_m is not None:
                wide[:, cols : cols + b_m.shape[1]] = b_m * scaling
                cols += b_m.shape[1]
            parts.append(wide)
        if kind is ShardKind.QKV:
            heads, groups = spec.num_attention_heads // shard[1], spec.num_query_groups // shard[1]
            b = qkv_hf_to_megatron(*parts, num_heads=heads, num_query_groups=groups)
        elif kind is ShardKind.SWIGLU_FC1:
            b = fc1_hf_to_megatron(*parts)
        else:
            b = parts[0]
        out[name] = LowRank(name, kind, a, b, shard)
    return out
