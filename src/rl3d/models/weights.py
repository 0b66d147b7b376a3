"""Load weights into a built GPTModel on each rank, and save a live model's shards.

`load_weights(model, spec, groups, src)` takes an HF directory, a Megatron weight directory
or a training checkpoint's role directory (`rl3d.models.ckpt_source`), any tp, pp, and copies
into this rank's parameters exactly its shard, one tensor at a time.
`save_weights(model, spec, groups, dst, hf_config=...)` writes the Megatron weight directory
of `rl3d.models.convert` from a live model (DP rank 0 of each shard writes its own file), which
`mcore_to_hf` then turns into an HF directory.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rl3d.models.bootstrap import MegatronGroups
from rl3d.models.builder import rank_param_names
from rl3d.models.convert import HF_EXTRA, META_NAME, McoreMeta, McoreReader
from rl3d.models.hf_mapping import tensor_maps
from rl3d.models.params import EMBEDDING, OUTPUT_LAYER, local_param, megatron_params, model_tensors
from rl3d.models.safetensors_io import ShardedReader
from rl3d.models.spec import ModelSpec
from rl3d.models.training import unwrap_model
from rl3d.ops.layouts import shard_for_tp

logger = logging.getLogger(__name__)


class HFSource:
    """Megatron shards computed from an HF directory on the fly."""

    def __init__(self, directory: str | Path, spec: ModelSpec, padded_vocab: int) -> None:
        self._reader = ShardedReader(directory)
        self._maps = {m.mcore: m for m in tensor_maps(spec, padded_vocab)}

    def shard(self, name: str, tp: int, tp_rank: int, padded_vocab: int) -> torch.Tensor:
        tmap = self._maps[name]
        full = tmap.to_mcore([self._reader.get(n) for n in tmap.hf])
        return shard_for_tp(full, tmap.kind, tp, tp_rank)

    def close(self) -> None:
        self._reader.close()


def _open_source(src: str | Path, spec: ModelSpec, padded_vocab: int) -> Any:
    src = Path(src)
    if (src / META_NAME).exists():
        reader = McoreReader(src)
        if reader.meta.spec.num_layers != spec.num_layers or reader.meta.spec.hidden_size != spec.hidden_size:
            raise ValueError(f"{src} holds {reader.meta.spec.name}, not a {spec.name}-shaped model")
        return reader
    if (src / "config.json").exists():
        return HFSource(src, spec, padded_vocab)
    from rl3d.models.ckpt_source import DistCheckpointSource, is_dist_checkpoint

    if is_dist_checkpoint(src):  # a training checkpoint's role directory (step_N/actor)
        return DistCheckpointSource(src, spec)
    raise FileNotFoundError(
        f"{src} is neither an HF directory, an rl3d Megatron weight directory nor a training checkpoint"
    )


def load_weights(
    model: Any, spec: ModelSpec, groups: MegatronGroups, src: str | Path, *, role: str = "actor"
) -> None:
    """Copy this rank's shard of every parameter from `src` (HF or Megatron directory) into `model`.

    The critic's value head is not in an HF checkpoint and keeps its initial weights.
    """
    model = unwrap_model(model)
    layout = groups.layout
    padded = model.vocab_size
    params = model_tensors(model)
    names = rank_param_names(spec, groups, role=role)
    experts = {p.name for p in megatron_params(spec, role=role) if p.expert is not None}
    source = _open_source(src, spec, padded)
    loaded = set()
    try:
        with torch.no_grad():
            for global_name, local in names.items():
                if role == "critic" and global_name == OUTPUT_LAYER:
                    continue
                param = local_param(params, local)
                if global_name in experts:  # split over the expert TP group
                    param.copy_(source.shard(global_name, layout.expert_t, groups.etp_rank, padded))
                else:
                    param.copy_(source.shard(global_name, layout.t, groups.tp_rank, padded))
                loaded.add(id(param))
            tied_copy = params.get(OUTPUT_LAYER)
            if tied_copy is not None and spec.tied_embeddings and role != "critic" and layout.p > 1:
                tied_copy.copy_(source.shard(EMBEDDING, layout.t, groups.tp_rank, padded))
                loaded.add(id(tied_copy))
    finally:
        source.close()
    kept = {OUTPUT_LAYER} if role == "critic" else set()  # the value head
    skipped = [n for n, p in params.items() if id(p) not in loaded and n not in kept]
    assert not skipped, f"parameters not loaded from {src}: {skipped}"
    logger.info("loaded %s into %s stage %d tp %d", src, role, groups.pp_rank, groups.tp_rank)


def save_weights(
    model: Any, spec: ModelSpec, groups: MegatronGroups, dst: str | Path, *, hf_config: dict[str, Any]
) -> None:
    """Write a live actor's weights as a Megatron weight directory (collective over the world)."""
    from safetensors.torch import save_file

    model = unwrap_model(model)
    layout, dst = groups.layout, Path(dst)
    params = model_tensors(model)
    meta = McoreMeta(
        layout.t,
        layout.p,
        model.vocab_size,
        hf_config["model_type"],
        spec,
        hf_config,
        ep=layout.ep,
        etp=layout.etp,
    )
    names = rank_param_names(spec, groups)
    c = groups.coords
    if layout.etp is None:  # one file per (tp, pp, ep): the first replica of every expert shard
        files = {meta.shard_dir(c.tp, c.pp, c.ep): names.values()} if c.dp < layout.ep else {}
    else:  # dense weights from data-parallel rank 0, experts from expert-data-parallel rank 0
        experts = {p.name for p in megatron_params(spec) if p.expert is not None}
        files = {}
        if c.dp == 0:
            files[meta.shard_dir(c.tp, c.pp)] = [
                local for name, local in names.items() if name not in experts
            ]
        if c.edp == 0:
            files[meta.shard_dir(c.etp, c.pp, c.ep, expert=True)] = [names[n] for n in names if n in experts]
    for where, locals_ in files.items():
        tensors = {local: local_param(params, local).detach().to("cpu").contiguous() for local in locals_}
        (dst / where).mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(dst / where / "model.safetensors"), metadata={"format": "pt"})
    if groups.rank == 0:
        meta.write(dst)
        (dst / HF_EXTRA).mkdir(exist_ok=True)
        (dst / HF_EXTRA / "config.json").write_text(json.dumps(hf_config, indent=2))
    dist.barrier()
