"""PEFT adapter directories in and out: `adapter_config.json` + `adapter_model.safetensors`,
loadable by `peft.PeftModel.from_pretrained(hf_model, directory)`; and LoRA merged into HF
weights (what `rl3d export --merge` writes).

Adapters here are full (t=1) fp32 tensors under PEFT's keys (`rl3d.models.lora_names`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from rl3d.models.lora_names import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    LM_HEAD,
    LORA_TARGETS,
    TARGETS,
    adapter_config,
    peft_key,
    resolve_targets,
    scaling_of,
)


def save_peft_adapter(
    directory: str | Path, state: dict[str, torch.Tensor], lora: Any, *, base: str | None
) -> Path:
    """Write `state` (PEFT keys -> full tensors) and `lora`'s settings (`actor.lora`) as a PEFT
    adapter directory; `base` is the HF model it adapts (adapter_config's base_model_name_or_path)."""
    from safetensors.torch import save_file

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    config = adapter_config(
        rank=lora.rank,
        alpha=lora.alpha,
        targets=getattr(lora, "peft_targets", lora.targets),
        dropout=lora.dropout,
        use_rslora=lora.use_rslora,
        base=base,
    )
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    save_file(
        {k: v.detach().contiguous().cpu() for k, v in sorted(state.items())}, str(out / ADAPTER_WEIGHTS)
    )
    return out


def read_adapter_config(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / ADAPTER_CONFIG
    if not path.is_file():
        raise FileNotFoundError(f"{directory}: no {ADAPTER_CONFIG} (not a PEFT adapter directory)")
    config = json.loads(path.read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{path}: peft_type {config.get('peft_type')!r}, only LORA adapters load")
    return config


def load_peft_adapter(directory: str | Path, lora: Any) -> dict[str, torch.Tensor]:
    """The tensors of a PEFT LoRA adapter directory, checked against `lora` (`actor.lora`): the
    same rank, scaling and adapted projections, or an error naming the file and the setting."""
    from safetensors.torch import load_file

    config = read_adapter_config(directory)
    where = Path(directory) / ADAPTER_CONFIG
    targets = config.get("target_modules") or []
    if isinstance(targets, str):  # PEFT writes "all-linear" or a regex as one string
        targets = [targets]
    unknown = [t for t in targets if t not in (*LORA_TARGETS, LM_HEAD, "all-linear")]
    if unknown:
        raise ValueError(
            f"{where}: target_modules {unknown} are not among {', '.join(LORA_TARGETS)}, {LM_HEAD}"
        )
    theirs = {
        "r": config.get("r"),
        "scaling": scaling_of(
            config.get("r", 8), config.get("lora_alpha", 8), config.get("use_rslora", False)
        ),
        "target_modules": sorted(resolve_targets(targets)) + ([LM_HEAD] if LM_HEAD in targets else []),
    }
    ours = {
        "r": lora.rank,
        "scaling": lora.scaling,
        "target_modules": sorted(lora.targets) + ([LM_HEAD] if lora.lm_head else []),
    }
    for key, value in ours.items():
        same = abs(theirs[key] - value) < 1e-12 if key == "scaling" else theirs[key] == value
        if not same:
            raise ValueError(f"{where}: {key} is {theirs[key]}, actor.lora has {value}")
    weights = Path(directory) / ADAPTER_WEIGHTS
    if not weights.is_file():
        raise FileNotFoundError(f"{directory}: no {ADAPTER_WEIGHTS}")
    state = load_file(str(weights))
    # PEFT's saved keys carry no adapter name; a few writers keep ".default". With lm_head targeted
    # peft also saves the base output layer (`lm_head.base_layer.weight`): the base is model.hf_path's
    kept = {k: v for k, v in state.items() if ".base_layer." not in k}
    return {k.replace(".default.weight", ".weight"): v.float() for k, v in kept.items()}


def merge_into_hf(
    hf_state: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor], *, scaling: float, num_layers: int
) -> dict[str, torch.Tensor]:
    """HF weights with every adapter merged: W + scaling * B @ A (summed in fp32, back in W's
    dtype; lm_head too when adapted). `hf_state` is not changed."""
    out = dict(hf_state)
    if peft_key(None, LM_HEAD, "A") in adapters:
        w = hf_state["lm_head.weight"]
        b, a = adapters[peft_key(None, LM_HEAD, "B")], adapters[peft_key(None, LM_HEAD, "A")]
        out["lm_head.weight"] = (w.float() + scaling * b.float() @ a.float()).to(w.dtype)
    for layer in range(num_layers):
        for target in LORA_TARGETS:
            a_key = peft_key(layer, target, "A")
            if a_key not in adapters:
                continue
            name = f"model.layers.{layer}.{TARGETS[target].hf_module}.weight"
            w = hf_state[name]
            delta = scaling * adapters[peft_key(layer, target, "B")].float() @ adapters[a_key].float()
            out[name] = (w.float() + delta).to(w.dtype)
    return out


def checkpoint_adapters(
    reader: Any, spec: Any, targets: tuple[str, ...], *, lm_head: bool = False
) -> dict[str, torch.Tensor]:
    """The adapters of a LoRA actor's dist checkpoint (`rl3d.models.export.DistCheckpointReader`:
    each factor stacked over the layers, TP shards at their offsets) under PEFT's keys."""
    from rl3d.models.lora import ADAPTER_SUFFIX, OUTPUT_LINEAR

    out = {}
    if lm_head:
        for factor in ("A", "B"):
            full = reader.full(f"{OUTPUT_LINEAR}{ADAPTER_SUFFIX}.{factor}.{LM_HEAD}").float()
            out[peft_key(None, LM_HEAD, factor)] = full[: spec.vocab_size] if factor == "B" else full
    for layer in range(spec.num_layers):
        for target in targets:
            linear = TARGETS[target].linear
            for factor in ("A", "B"):
                name = f"decoder.layers.{layer}.{linear}{ADAPTER_SUFFIX}.{factor}.{target}"
                out[peft_key(layer, target, factor)] = reader.full(name).float()
    return out


class MergedReader:
    """A reader of full Megatron tensors (`reader.full`, `reader.dtype`) whose adapted weights
    come back merged: W + scaling * B @ A, in W's dtype (what `rl3d export --merge` writes)."""

    def __init__(self, reader: Any, spec: Any, adapters: dict[str, torch.Tensor], *, scaling: float):
        from rl3d.models.hf_mapping import tensor_maps

        self.reader, self.spec, self.adapters, self.scaling = reader, spec, adapters, scaling
        self.padded_vocab = reader.padded_vocab
        self.maps = {m.mcore: m for m in tensor_maps(spec, reader.padded_vocab)}

    def dtype(self, name: str) -> torch.dtype:
        return self.reader.dtype(name)

    def full(self, name: str) -> torch.Tensor:
        base = self.reader.full(name)
        lm_a = peft_key(None, LM_HEAD, "A")
        if name == "output_layer.weight" and lm_a in self.adapters:  # [V_pad, h]: the vocabulary's rows
            b = self.adapters[peft_key(None, LM_HEAD, "B")]
            delta = self.scaling * b.float() @ self.adapters[lm_a].float()
            out = base.float()
            out[: delta.shape[0]] += delta
            return out.to(base.dtype)
        tmap = self.maps.get(name)
        if tmap is None or not name.startswith("decoder.layers.") or not name.endswith(".weight"):
            return base  # adapters change weights only (a QKV bias stays as it is)
        layer = int(name.split(".")[2])
        parts = []  # each HF tensor's update, zero where it has no adapter
        for hf_name, hf_base in zip(tmap.hf, tmap.to_hf(base)):
            target = hf_name.split(".")[-2]  # model.layers.{i}.self_attn.q_proj.weight
            a_key = peft_key(layer, target, "A") if target in TARGETS else None
            if a_key in self.adapters:
                b = self.adapters[peft_key(layer, target, "B")]
                parts.append(self.scaling * b.float() @ self.adapters[a_key].float())
            else:
                parts.append(torch.zeros(hf_base.shape))
        if all(not p.any() for p in parts):
            return base
        return (base.float() + tmap.to_mcore(parts)).to(base.dtype)
