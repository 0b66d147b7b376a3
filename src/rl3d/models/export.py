"""A training checkpoint's model as an HF directory, in one process, whatever layout saved it.

    export_hf(RUN_DIR/checkpoints/step_N/actor, spec, DST, source=HF_DIR)

The checkpoint is megatron's dist checkpoint (`rl3d.models.dist_checkpoint`, torch_dist format):
every parameter is stored as one global tensor (TP shards at their offsets, the layers stacked
along a leading axis, a mixture of experts' expert weights along a second one by global expert
index, whatever the expert parallelism that saved them; a model whose layers differ, GLM-4.5's
dense first layers, keeps one key per layer instead of the layer axis), so torch.distributed.checkpoint reads
it with no process group and no knowledge of the (t, p, d) that wrote it.
`DistCheckpointReader` reads one layer's (and expert's) slice of
one parameter at a time (peak memory: the largest single tensor), and the HF writer of
`rl3d.models.convert` turns the Megatron tensors into HF ones with the same maps as
`rl3d convert mcore2hf`. Tensors keep the checkpoint's dtype, so HF -> train at lr 0 -> export
gives the HF tensors back bit for bit.

DST gets the safetensors, config.json (the source's, else one made from the spec) and the
source directory's other files (tokenizer, generation config), written atomically: a failed
export leaves no DST and an existing DST as it was.
"""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path
from typing import Any

import torch

from rl3d.models.convert import HF_EXTRA, META_NAME, atomic_output, copy_extras, write_hf_weights
from rl3d.models.params import EMBEDDING, EXPERT_PREFIX, TE_NAMES
from rl3d.models.spec import ModelSpec

logger = logging.getLogger(__name__)

HF_SUBDIR = "hf"  # a checkpoint's HF export with `checkpoint.save_hf` (step_N/hf)

# Megatron's dist-checkpoint keys of layer parameters that are not the module's own names:
# both layer specs save their layernorms under the fused (Transformer Engine) names.
_LAYER_KEYS = {suffix: (te_suffix, suffix) for suffix, te_suffix in TE_NAMES.items()}


def _slice_planner(key: str, index: tuple[int, ...], storage: Any) -> Any:
    """A load planner that reads only the slice `index` (leading stacked axes: layer, then
    expert) of the tensor `key`; all of it when `index` is empty."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.checkpoint.planner import LoadPlan
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    class SlicePlanner(DefaultLoadPlanner):
        def create_local_plan(self) -> LoadPlan:
            size, n = storage.size, len(index)
            offsets = torch.Size([*index] + [0] * (len(size) - n))
            sizes = torch.Size([1] * n + list(size[n:]))
            chunk = ChunkStorageMetadata(offsets=offsets, sizes=sizes)
            return LoadPlan(create_read_items_for_chunk_list(key, storage, [chunk]))

        def lookup_tensor(self, index: Any) -> torch.Tensor:  # the slice itself, not a shard of it
            return self.state_dict[index.fqn]

    return SlicePlanner(flatten_state_dict=False, flatten_sharded_tensors=False)


class DistCheckpointReader:
    """Full (t=1) tensors by global Megatron name from a megatron dist checkpoint directory."""

    def __init__(self, directory: str | Path, spec: ModelSpec) -> None:
        from torch.distributed.checkpoint import FileSystemReader

        self.directory, self.spec = Path(directory), spec
        backend = _sharded_backend(self.directory)
        if backend != "torch_dist":
            raise ValueError(f"{self.directory}: sharded backend {backend!r}, rl3d reads 'torch_dist' only")
        self._tensors = FileSystemReader(str(self.directory)).read_metadata().state_dict_metadata
        embedding = self._storage(EMBEDDING)
        self.padded_vocab = int(embedding.size[0])
        if self.padded_vocab < spec.vocab_size or tuple(embedding.size[1:]) != (spec.hidden_size,):
            raise ValueError(
                f"{self.directory}: embedding {tuple(embedding.size)} does not fit {spec.name} "
                f"(vocab {spec.vocab_size}, hidden {spec.hidden_size})"
            )

    def _storage(self, key: str) -> Any:
        storage = self._tensors.get(key)
        if storage is None or not hasattr(storage, "chunks"):
            raise ValueError(f"{self.directory}: no tensor {key!r} in the checkpoint (another model?)")
        return storage

    def _locate(self, name: str) -> tuple[str, tuple[int, ...]]:
        """The checkpoint key holding global parameter `name`, and its index along the stacked
        axes: (layer,), or (layer, expert) for an expert's weight, whose global expert index
        megatron stacks after the layer's."""
        if not name.startswith("decoder.layers."):
            return name, ()
        _, _, index, suffix = name.split(".", 3)
        expert = ()
        if suffix.startswith(EXPERT_PREFIX):
            number, rest = suffix[len(EXPERT_PREFIX) :].split(".", 1)
            suffix, expert = f"mlp.experts.experts.{rest}", (int(number),)
        for candidate in _LAYER_KEYS.get(suffix, (suffix,)):
            key = f"decoder.layers.{candidate}"
            if key in self._tensors:
                size = self._tensors[key].size
                if size[0] != self.spec.num_layers:
                    raise ValueError(
                        f"{self.directory}: {key} stacks {size[0]} layers, {self.spec.name} has "
                        f"{self.spec.num_layers}"
                    )
                return key, (int(index), *expert)
            # layers that differ (dense first layers) are saved one key per layer, unstacked
            if (key := f"decoder.layers.{index}.{candidate}") in self._tensors:
                return key, expert
        raise ValueError(f"{self.directory}: no tensor for {name} in the checkpoint (another model?)")

    def dtype(self, name: str) -> torch.dtype:
        return self._storage(self._locate(name)[0]).properties.dtype

    def full(self, name: str) -> torch.Tensor:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemReader

        key, index = self._locate(name)
        storage = self._storage(key)
        out = torch.empty(
            torch.Size([1] * len(index) + list(storage.size[len(index) :])), dtype=storage.properties.dtype
        )
        with warnings.catch_warnings():  # "assuming ... a single process": yes, by design
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(
                {key: out},
                storage_reader=FileSystemReader(str(self.directory)),
                planner=_slice_planner(key, index, storage),
                no_dist=True,
            )
        return out.reshape(storage.size[len(index) :])


def _sharded_backend(directory: Path) -> str | None:
    path = directory / "metadata.json"
    if not path.is_file():
        raise FileNotFoundError(f"{directory}: not a megatron dist checkpoint (no metadata.json)")
    return json.loads(path.read_text()).get("sharded_backend")


def hf_config_for(spec: ModelSpec, source: str | Path | None, dtype: torch.dtype) -> dict[str, Any]:
    """The source directory's config.json (an rl3d Megatron directory's HF config), else one
    made from the spec; its dtype says what the export holds."""
    config = None
    if source is not None:
        source = Path(source)
        if (source / "config.json").is_file():
            config = json.loads((source / "config.json").read_text())
        elif (source / META_NAME).is_file():
            config = json.loads((source / META_NAME).read_text()).get("hf_config")
    if config is None:
        from rl3d.models.hf_mapping import hf_config_from_spec

        hf = hf_config_from_spec(spec)
        config = {**hf.to_dict(), "architectures": [type(hf).__name__.replace("Config", "ForCausalLM")]}
    name = str(dtype).removeprefix("torch.")
    for key in ("torch_dtype", "dtype"):
        if key in config or key == "torch_dtype":
            config[key] = name
    return config


def export_hf(
    checkpoint: str | Path,
    spec: ModelSpec,
    dst: str | Path,
    *,
    source: str | Path | None = None,
    max_shard_bytes: int = 5 * 2**30,
    merge_lora: dict[str, Any] | None = None,
) -> Path:
    """Write the model of dist checkpoint `checkpoint` (a role's directory, e.g. step_N/actor)
    as an HF directory `dst`; `source` is the HF (or rl3d Megatron) directory the run started
    from, whose config and tokenizer files are carried over. `merge_lora` ({"adapters": PEFT-keyed
    tensors, "scaling": float}) merges LoRA adapters into the weights written."""
    dst = Path(dst)
    reader = DistCheckpointReader(checkpoint, spec)
    if merge_lora is not None:
        from rl3d.models.lora_peft import MergedReader

        reader = MergedReader(reader, spec, merge_lora["adapters"], scaling=merge_lora["scaling"])
    dtype = reader.dtype(EMBEDDING)
    with atomic_output(dst) as out:
        names = write_hf_weights(reader, spec, reader.padded_vocab, out, max_shard_bytes)
        if source is not None and Path(source).is_dir():
            source = Path(source)
            extras = source / HF_EXTRA if (source / META_NAME).is_file() else source
            copy_extras(extras, out)
        config = hf_config_for(spec, source, dtype)
        (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    logger.info("exported %s as HF directory %s (%d weight files)", checkpoint, dst, len(names))
    return dst
