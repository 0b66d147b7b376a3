"""A training checkpoint's model as a weight source: this rank's shard of each parameter, read
from megatron's dist checkpoint (a run's `checkpoints/step_N/actor`) whatever layout saved it.

The dist checkpoint stores every parameter as one global tensor (`rl3d.models.export`), so a
shard for any tensor-parallel size is the global tensor's slice; the vocabulary rows are
re-padded for this model's padded vocabulary first. `rl3d.models.weights.load_weights` reads a
role directory through it, as it reads an HF or an rl3d Megatron weight directory.
"""

from __future__ import annotations

from pathlib import Path

import torch

from rl3d.models.export import DistCheckpointReader
from rl3d.models.hf_mapping import tensor_maps
from rl3d.models.params import EMBEDDING, OUTPUT_LAYER
from rl3d.models.spec import ModelSpec
from rl3d.ops.layouts import shard_for_tp

CHECKPOINT_METADATA = "metadata.json"  # what marks a dist checkpoint directory


def is_dist_checkpoint(path: str | Path) -> bool:
    return (Path(path) / CHECKPOINT_METADATA).is_file()


class DistCheckpointSource:
    """Megatron shards, for any tp, of the model in dist checkpoint `directory`."""

    def __init__(self, directory: str | Path, spec: ModelSpec) -> None:
        self._reader = DistCheckpointReader(directory, spec)
        self._spec = spec
        self._kinds = {m.mcore: m.kind for m in tensor_maps(spec, self._reader.padded_vocab)}

    def shard(self, name: str, tp: int, tp_rank: int, padded_vocab: int) -> torch.Tensor:
        full = self._reader.full(name)
        if name in (EMBEDDING, OUTPUT_LAYER) and full.shape[0] != padded_vocab:
            vocab = self._spec.vocab_size
            repadded = full.new_zeros(padded_vocab, *full.shape[1:])
            repadded[:vocab] = full[:vocab]
            full = repadded
        return shard_for_tp(full, self._kinds[name], tp, tp_rank)

    def close(self) -> None:
        pass
