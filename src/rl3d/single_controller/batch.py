"""`DataBatch`: what moves between the controller and the worker groups.

A dict of tensors that share their leading (sample) dimension, per-sample non-tensor fields
(lists of the same length), and batch-level info. It splits, concatenates (tensors of
different widths right-padded, with `info[PAD_VALUES]` where a field names its pad value),
selects and moves between devices; it pickles, so the Ray backend can carry it through the
object store.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

# batch-level info: {field: value} a field is right-padded with when batches of different widths
# concatenate (default 0), e.g. token ids padded with the tokenizer's pad id
PAD_VALUES = "pad_values"
# batch-level info of a prompt batch: its longest prompt, so every share of it left-pads alike
PROMPT_WIDTH = "prompt_width"
# batch-level info of a step's batch with more rows than its nominal samples (prompts x n; an
# agent's extra rows, padded by `rl3d.controller.rows`): mini-batches scale with it
NOMINAL_ROWS = "nominal_rows"
# per-sample fields of a mixture of experts' routing replay (`rl3d.models.routing_replay`): the
# experts of every token [B, T, layers, top_k] aligned with input_ids, and how many decisions
# (token x layer) of a sample the trainer's own router made otherwise than that record
ROUTING = "routing"
ROUTING_DIFFER = "routing_differ"
ROUTING_DECISIONS = "routing_decisions"


def mini_batch_rows(mini_batch_size: int, info: dict[str, Any], rows: int) -> int:
    """The rows of one mini-batch of `mini_batch_size` samples in a batch of `rows` (all
    data-parallel ranks): as many mini-batches as over the nominal samples."""
    nominal = info.get(NOMINAL_ROWS)
    return mini_batch_size if nominal is None else mini_batch_size * rows // nominal


@dataclass
class DataBatch:
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    meta: dict[str, list] = field(default_factory=dict)  # per-sample, non-tensor
    info: dict[str, Any] = field(default_factory=dict)  # batch-level

    def __post_init__(self) -> None:
        sizes = {k: v.shape[0] for k, v in self.tensors.items()} | {k: len(v) for k, v in self.meta.items()}
        if len(set(sizes.values())) > 1:
            raise ValueError(f"DataBatch fields disagree on the batch size: {sizes}")

    def __len__(self) -> int:
        for v in self.tensors.values():
            return v.shape[0]
        for v in self.meta.values():
            return len(v)
        return 0

    def __getitem__(self, key: str) -> torch.Tensor | list:
        if key in self.tensors:
            return self.tensors[key]
        if key in self.meta:
            return self.meta[key]
        raise KeyError(f"DataBatch has no field {key!r}; fields: {sorted([*self.tensors, *self.meta])}")

    def __contains__(self, key: str) -> bool:
        return key in self.tensors or key in self.meta

    def set(self, key: str, value: torch.Tensor | list) -> DataBatch:
        n = len(self)
        size = value.shape[0] if isinstance(value, torch.Tensor) else len(value)
        if self.tensors or self.meta:
            if size != n:
                raise ValueError(f"field {key!r} has {size} rows, the batch has {n}")
        (self.tensors if isinstance(value, torch.Tensor) else self.meta)[key] = value
        return self

    def select(self, index: Sequence[int] | torch.Tensor) -> DataBatch:
        idx = torch.as_tensor(index, dtype=torch.long)
        rows = idx.tolist()
        return DataBatch(
            {k: v[idx] for k, v in self.tensors.items()},
            {k: [v[i] for i in rows] for k, v in self.meta.items()},
            dict(self.info),
        )

    def slice(self, start: int, stop: int) -> DataBatch:
        return DataBatch(
            {k: v[start:stop] for k, v in self.tensors.items()},
            {k: v[start:stop] for k, v in self.meta.items()},
            dict(self.info),
        )

    def split(self, num_chunks: int) -> list[DataBatch]:
        """`num_chunks` equal consecutive chunks (the batch size must divide)."""
        n = len(self)
        if num_chunks < 1 or n % num_chunks:
            raise ValueError(f"cannot split a batch of {n} into {num_chunks} equal chunks")
        size = n // num_chunks
        return [self.slice(i * size, (i + 1) * size) for i in range(num_chunks)]

    def chunks_of(self, size: int) -> list[DataBatch]:
        n = len(self)
        if size < 1 or n % size:
            raise ValueError(f"cannot cut a batch of {n} into chunks of {size}")
        return [self.slice(i, i + size) for i in range(0, n, size)]

    @staticmethod
    def concat(batches: Iterable[DataBatch]) -> DataBatch:
        batches = list(batches)
        if not batches:
            return DataBatch()
        keys_t, keys_m = set(batches[0].tensors), set(batches[0].meta)
        for b in batches[1:]:
            if set(b.tensors) != keys_t or set(b.meta) != keys_m:
                raise ValueError("cannot concatenate DataBatches with different fields")
        pad = batches[0].info.get(PAD_VALUES, {})
        return DataBatch(
            {k: _cat_padded([b.tensors[k] for b in batches], pad.get(k, 0)) for k in batches[0].tensors},
            {k: [x for b in batches for x in b.meta[k]] for k in batches[0].meta},
            dict(batches[0].info),
        )

    def to(self, device: torch.device | str) -> DataBatch:
        return DataBatch({k: v.to(device) for k, v in self.tensors.items()}, self.meta, self.info)

    def union(self, other: DataBatch) -> DataBatch:
        """Fields of both (same rows); `other` wins on a name clash."""
        if self.tensors or self.meta:
            if other.tensors or other.meta:
                if len(other) != len(self):
                    raise ValueError(f"union of batches with {len(self)} and {len(other)} rows")
        return DataBatch(
            {**self.tensors, **other.tensors}, {**self.meta, **other.meta}, {**self.info, **other.info}
        )


def _cat_padded(tensors: list[torch.Tensor], value: float = 0) -> torch.Tensor:
    """Concatenate along dim 0, right-padding later dims with `value` when they differ."""
    if len({t.shape[1:] for t in tensors}) == 1:
        return torch.cat(tensors)
    shape = [max(t.shape[d] for t in tensors) for d in range(1, tensors[0].dim())]
    out = []
    for t in tensors:
        pad = []
        for d in reversed(range(1, t.dim())):
            pad += [0, shape[d - 1] - t.shape[d]]
        out.append(torch.nn.functional.pad(t, pad, value=value))
    return torch.cat(out)


def to_host(obj: Any) -> Any:
    """`obj` with every tensor inside (DataBatches, dicts, tuples, lists) on the CPU. Every
    backend applies it to what a worker returns: a CUDA tensor in a pickle unpickles onto the
    sender's GPU index, a device of another process, and the controller computes on the host."""
    if isinstance(obj, torch.Tensor):
        return obj.cpu()
    if isinstance(obj, DataBatch):
        return DataBatch({k: v.cpu() for k, v in obj.tensors.items()}, obj.meta, obj.info)
    if isinstance(obj, dict):
        return {k: to_host(v) for k, v in obj.items()}
    if isinstance(obj, (tuple, list)):
        return type(obj)(to_host(v) for v in obj)
    return obj
