"""How a worker method's input is split over ranks and its output collected.

A worker method declares its mode with `@register(Dispatch.X)`. Each mode is a (split,
collect) pair over one axis of the ranks (`DispatchMode`):
- ONE_TO_ALL: every rank gets the same arguments; the output of any rank is the result (the
  method must compute the same thing everywhere, or return None where it has nothing).
- DP_COMPUTE: the batch is split into `dp_size` equal chunks, one per rank of a pure data-
  parallel group; every rank's output is collected, in rank order.
- MEGATRON_COMPUTE: the batch is split over the data-parallel ranks of a megatron grid; the
  output is collected from tp = 0 on the last pipeline stage of each DP rank. A trained role
  (padded or packed) sets `token_balance` to its global mini-batch size: every mini-batch's
  samples are dealt to the DP ranks by token count (`rl3d.utils.partition.chunked_partition`),
  so an optimizer step trains on the same samples at any DP size, and output rows are put back
  in input order. With `token_balance` 0 the batch splits in contiguous chunks.
- GENERATION_COMPUTE: the batch (prompts) is dealt round-robin over the generation-DP ranks
  of the actor's generation layout (row i to generation-DP rank i mod size); the output is
  collected from generation-TP rank 0 and put back in input order. Its output rows carry
  `INPUT_ROW`, the row of the rank's share they answer (a prompt may give several rows).

Collected metric dicts are reduced as the method declares (`metrics="mean"`, the default: each
rank reports a mean over its share; `"sum"`: each reports counts). A worker tells where it sits
with `dispatch_info()`. The backends (`rl3d.single_controller.spmd`, `.ray`) run the same
modes; the RL loop only ever calls `group.call("method", batch)`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol

import torch

from rl3d.single_controller.batch import DataBatch, mini_batch_rows
from rl3d.utils.partition import chunked_partition

DISPATCH_ATTR = "__rl3d_dispatch__"
METRICS_ATTR = "__rl3d_metrics__"
INPUT_ROW = "input_row"  # GENERATION_COMPUTE outputs: the row of the rank's share a row answers


class Dispatch(str, Enum):
    ONE_TO_ALL = "one_to_all"
    DP_COMPUTE = "dp_compute"
    MEGATRON_COMPUTE = "megatron_compute"
    GENERATION_COMPUTE = "generation_compute"


def register(mode: Dispatch, *, metrics: str = "mean") -> Callable:
    """Decorator: declare a worker method's dispatch mode, and how its metric dicts reduce
    when several ranks or slices report them ("mean" or "sum")."""
    assert metrics in ("mean", "sum"), metrics

    def mark(fn: Callable) -> Callable:
        setattr(fn, DISPATCH_ATTR, Dispatch(mode))
        setattr(fn, METRICS_ATTR, metrics)
        return fn

    return mark


def dispatch_mode(method: Callable) -> Dispatch:
    return getattr(method, DISPATCH_ATTR, Dispatch.ONE_TO_ALL)


def metrics_reduction(method: Callable) -> str:
    return getattr(method, METRICS_ATTR, "mean")


@dataclass(frozen=True)
class DispatchInfo:
    dp_rank: int
    dp_size: int
    is_collector: bool  # MEGATRON_COMPUTE: tp == 0 on the last pipeline stage
    gen_dp_rank: int = 0  # GENERATION_COMPUTE: the rank's place in the generation layout
    gen_dp_size: int = 1
    is_gen_collector: bool = True  # generation TP rank 0
    token_balance: int = 0  # MEGATRON_COMPUTE: 0, or the mini-batch whose tokens to balance


class Worker(Protocol):
    def dispatch_info(self) -> DispatchInfo: ...


@dataclass(frozen=True)
class Slot:
    """Where one rank sits on a mode's axis: ranks with one `index` get the same share."""

    index: int
    size: int
    collects: bool
    token_balance: int = 0


@dataclass(frozen=True)
class DispatchMode:
    slot: Callable[[DispatchInfo], Slot]
    split: Callable[[DataBatch, Slot], DataBatch]
    # (slot, output) of every collector, the metric reduction, and the call's input batch
    collect: Callable[[list[tuple[Slot, Any]], str, Any], Any]
    gathers: bool = True  # False: ONE_TO_ALL, nothing to split or collect


def _chunk(batch: DataBatch, slot: Slot) -> DataBatch:
    return batch.split(slot.size)[slot.index]


def _round_robin(batch: DataBatch, slot: Slot) -> DataBatch:
    return batch.select(list(range(slot.index, len(batch), slot.size)))


def _token_shares(batch: DataBatch, slot: Slot) -> list[list[int]]:
    lengths = batch["attention_mask"].sum(1).tolist()
    chunk = mini_batch_rows(slot.token_balance, batch.info, len(batch))
    return chunked_partition(lengths, slot.size, min(chunk, len(batch)))


def _dp_share(batch: DataBatch, slot: Slot) -> DataBatch:
    if not slot.token_balance:
        return _chunk(batch, slot)
    return batch.select(_token_shares(batch, slot)[slot.index])


def _in_slot_order(parts: list[tuple[Slot, Any]], reduce: str, batch: Any = None) -> Any:
    parts = sorted(parts, key=lambda p: p[0].index)
    merged = merge_outputs([o for _, o in parts], metrics=reduce)
    if not parts or not parts[0][0].token_balance or not isinstance(merged, DataBatch):
        return merged
    order = [i for share in _token_shares(batch, parts[0][0]) for i in share]
    return merged.select(torch.argsort(torch.tensor(order)))


def _in_input_order(parts: list[tuple[Slot, Any]], reduce: str, batch: Any = None) -> Any:
    """Round-robin shares back in input order; rows of one input row keep their order."""
    batches = [(slot, out) for slot, out in parts if out is not None and len(out)]
    if not batches:
        return None
    merged = DataBatch.concat([out for _, out in batches])
    rows = torch.cat([slot.index + out[INPUT_ROW] * slot.size for slot, out in batches])
    order = torch.sort(rows, stable=True).indices
    merged.tensors.pop(INPUT_ROW)
    return merged.select(order)


MODES: dict[Dispatch, DispatchMode] = {
    Dispatch.ONE_TO_ALL: DispatchMode(
        slot=lambda info: Slot(0, 1, True),
        split=lambda batch, slot: batch,
        collect=lambda parts, reduce, batch=None: parts[0][1] if parts else None,
        gathers=False,
    ),
    Dispatch.DP_COMPUTE: DispatchMode(
        slot=lambda info: Slot(info.dp_rank, info.dp_size, True), split=_chunk, collect=_in_slot_order
    ),
    Dispatch.MEGATRON_COMPUTE: DispatchMode(
        slot=lambda info: Slot(info.dp_rank, info.dp_size, info.is_collector, info.token_balance),
        split=_dp_share,
        collect=_in_slot_order,
    ),
    Dispatch.GENERATION_COMPUTE: DispatchMode(
        slot=lambda info: Slot(info.gen_dp_rank, info.gen_dp_size, info.is_gen_collector),
        split=_round_robin,
        collect=_in_input_order,
    ),
}


def merge_outputs(outputs: list[Any], *, metrics: str = "mean") -> Any:
    """Collected outputs in order -> one result: batches concatenate, metric dicts reduce by
    `metrics` ("mean" or "sum"), tuples merge element-wise, lists concatenate."""
    outputs = [o for o in outputs if o is not None]
    if not outputs:
        return None
    first = outputs[0]
    if isinstance(first, tuple):
        return tuple(merge_outputs([o[i] for o in outputs], metrics=metrics) for i in range(len(first)))
    if isinstance(first, DataBatch):
        return DataBatch.concat(outputs)
    if isinstance(first, dict):
        keys = {k for o in outputs for k in o}
        totals = {k: sum(float(o[k]) for o in outputs if k in o) for k in keys}
        if metrics == "sum":
            return totals
        return {k: totals[k] / sum(1 for o in outputs if k in o) for k in keys}
    if isinstance(first, list):
        return [x for o in outputs for x in o]
    return outputs
