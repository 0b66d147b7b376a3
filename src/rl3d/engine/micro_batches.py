"""How an engine feeds its model: micro-batches (padded or packed) on the rank's device,
megatron's schedule shapes, and the forward step that runs one micro-batch (its output layer on
the response positions alone with `response_outputs`), inside its features' `around_forward`.

Sequences in a batch are `input_ids` = [left-padded prompt | right-padded response], with
`attention_mask` over both; `response_mask` [B, R] marks the response tokens.

Under sequence parallelism (`rl3d.models.sequence_parallel`) every forward's length is a
multiple of the TP size: a padded micro-batch gets pad columns on the left (mask 0; the model's
output over them is dropped before the loss reads it), a packed row pad tokens at its end.

Under context parallelism (`<role>.parallel.cp`) the padded length is also a multiple of
`2 * cp` (the pad columns again on the left), each CP rank runs its part of the sequence and the
last stage's output comes back whole on every CP rank (`rl3d.models.context_parallel`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import torch

from rl3d.engine.features import Features
from rl3d.engine.techniques import Packing, SequenceParallel
from rl3d.models.context_parallel import gather_positions, split_inputs
from rl3d.models.packing import (
    PACKED,
    pack_rows,
    packed_micro_batches,
    packed_model_inputs,
    per_sequence_rope,
    unpack_response,
)
from rl3d.models.sequence_parallel import gather_sequence, padded_length
from rl3d.single_controller.batch import ROUTING, DataBatch

SEQUENCE_FIELDS = ("input_ids", "attention_mask", ROUTING)  # a micro-batch's [B, T, ...] fields


def attention_mask_4d(attention_mask_BT: torch.Tensor) -> torch.Tensor:
    """[B, T] (1 = real token) -> megatron's [B, 1, T, T] bool mask (True = masked out)."""
    T = attention_mask_BT.shape[1]
    causal = torch.triu(torch.ones(T, T, dtype=torch.bool, device=attention_mask_BT.device), diagonal=1)
    key_pad = ~attention_mask_BT.bool()[:, None, None, :]
    return causal[None, None] | key_pad


def position_ids_of(attention_mask_BT: torch.Tensor) -> torch.Tensor:
    """Positions count real tokens only, so a left-padded prompt starts at position 0."""
    return (attention_mask_BT.long().cumsum(-1) - 1).clamp(min=0)


def left_pad(micro: DataBatch, width: int) -> DataBatch:
    """`micro` with `width` more pad columns (zeros: id 0, mask 0, no recorded experts) on the
    left of its sequence fields; every other field as it is."""
    padded = {}
    for key in SEQUENCE_FIELDS:
        if key in micro:
            x = micro[key]
            padded[key] = torch.cat([x.new_zeros((x.shape[0], width, *x.shape[2:])), x], 1)
    return DataBatch({**micro.tensors, **padded}, micro.meta, micro.info)


def packed(micro: DataBatch, multiple: int = 1) -> DataBatch:
    """`micro` with its packed row (`rl3d.models.packing`) in its info, each sequence's length
    padded to a multiple of `multiple`."""
    R = micro["response_mask"].shape[1]
    row = pack_rows(micro["input_ids"], micro["attention_mask"], response_width=R, multiple=multiple)
    return DataBatch(micro.tensors, micro.meta, {**micro.info, PACKED: row})


# The roles whose output is read only through `response_slice` as log-probs of the response tokens
# (the actor's old log-probs and its loss, the reference's and a teacher's log-probs): the output
# layer and the log-softmax over the vocabulary run on R positions instead of T. Equal to the
# whole-sequence output within 1e-6 in log-probs and gradients (fp32; a smaller matmul rounds
# differently: tests/distributed/workers/test_response_outputs_dist.py); on SmolLM2-135M's update
# 0.75x the wall time and 0.87x the CPU-seconds (docs/real_model_step.md).
RESPONSE_ONLY_ROLES = ("actor", "reference")


def response_outputs(role: str, *, cp: int = 1) -> bool:
    """Whether role `role`'s output layer runs on the response positions alone: what its engine
    does (`MicroBatches`) and what the memory plan counts its logits at
    (`rl3d.planning.memory_activations`). Not under context parallelism, where the last stage
    gathers the whole sequence's outputs back first (`rl3d.models.context_parallel`)."""
    return role in RESPONSE_ONLY_ROLES and cp == 1


def forward_micro_batch(section: Any, rows: int) -> int:
    """Samples per forward-only micro-batch over a rank's `rows` rows, for a role `section`
    (the actor's: `actor.log_prob_micro_batch_size`): its `micro_batch_size`, or with
    `log_prob_micro_batch_size` the largest count up to it that divides `rows` (equal
    micro-batches, which pipeline stages exchange at one shape). A forward-only pass reads each
    row's outputs alone, so fewer, larger micro-batches give the same log-probs (bit for bit on
    CPU: tests/distributed/workers/test_log_prob_micro_batch.py) with fewer TP collectives."""
    cap = getattr(section, "log_prob_micro_batch_size", None)
    if cap is None:
        return section.micro_batch_size
    return max(d for d in range(1, min(cap, rows) + 1) if rows % d == 0) if rows else cap


class MicroBatches:
    """How one engine's model is fed: micro-batches, megatron's schedule shapes and the forward
    step, for `model` (the unwrapped GPTModel) on `groups`, with the role's `features` (packing
    and sequence parallelism shape the micro-batches; every feature's `around_forward` runs
    around each forward). `response_outputs` runs the output layer on the response positions
    alone: on for the roles whose every reader of the output reads those positions' log-probs
    (`RESPONSE_ONLY_ROLES`), off for the critic (a value head of width 1: nothing to save) and
    the reward model (it reads each sequence's last token), and off under context parallelism
    (a CP rank holds positions spread over the sequence)."""

    def __init__(self, model: Any, groups: Any, *, role: str, features: Features):
        self.model, self.groups, self.role, self.features = model, groups, role, features
        self.packing = features.get(Packing)
        self.cp = groups.layout.cp
        assert self.cp == 1 or self.packing is None, "packing under context parallelism (refused by config)"
        # a CP rank's part (T / cp positions) splits again over TP under sequence parallelism
        split = groups.layout.t if features.get(SequenceParallel) else 1
        self.multiple = split if self.cp == 1 else self.cp * math.lcm(split, 2)  # 2 * cp chunks
        self.response_outputs = response_outputs(role, cp=self.cp)

    def split(self, batch: DataBatch, micro_batch_size: int) -> tuple[list[DataBatch], list[int] | None]:
        """Micro-batches on this rank's device (the controller's batches live on the host), and
        the sample order they hold when packing regrouped the samples by tokens (else None)."""
        order = None
        if self.packing is not None:
            lengths = batch["attention_mask"].sum(1).tolist()
            key = f"{self.role}.max_tokens_per_micro_batch"
            budget = self.packing.max_tokens
            groups = packed_micro_batches(
                lengths, micro_batch_size=min(micro_batch_size, len(batch)), budget=budget, key=key
            )
            order = [i for g in groups for i in g]
            chunks = [batch.select(g) for g in groups]
        else:
            chunks = batch.chunks_of(min(micro_batch_size, len(batch)))
        micro = [m.to(self.groups.device) for m in chunks]
        if self.packing is not None:
            micro = [packed(m, self.multiple) for m in micro]
        if order is not None and order == sorted(order):
            order = None  # the batch's own order
        return micro, order

    def schedule_shape(self, micro: list[DataBatch]) -> dict[str, int]:
        """seq_length and micro_batch_size for megatron's schedule (with packing, PP stages
        exchange each micro-batch's shape: `variable_seq_lengths`)."""
        if PACKED in micro[0].info:
            return {"seq_length": max(m.info[PACKED].num_tokens for m in micro), "micro_batch_size": 1}
        T = padded_length(micro[0]["input_ids"].shape[1], self.multiple)
        return {"seq_length": T, "micro_batch_size": len(micro[0])}

    def forward_step(self, extract: Callable[[torch.Tensor, DataBatch], tuple[torch.Tensor, dict]]):
        """megatron's forward step over one micro-batch; `extract(output, micro)` is its loss
        function (on the last stage)."""

        def step(micro: DataBatch, chunk: Any):
            row = micro.info.get(PACKED)
            strip = 0  # leading pad columns of the output, not the micro-batch's
            if row is None:
                T = micro["attention_mask"].shape[1]
                R = micro["response_mask"].shape[1] if "response_mask" in micro else 0
                pad = padded_length(T, self.multiple) - T
                seq = left_pad(micro, pad) if pad else micro
                mask = seq["attention_mask"]
                cut = None
                if self.response_outputs and R:
                    cut = self._output_positions(pad + T - R - 1, pad + T - 1)
                else:
                    strip = pad
                # the first pad columns' tokens are not the batch's
                around = self.features.around_forward(seq, lead=pad * len(micro), trail=0)
                inputs = seq["input_ids"], position_ids_of(mask), attention_mask_4d(mask)
                if self.cp > 1:
                    inputs = split_inputs(*inputs, cp=self.cp, rank=self.groups.cp_rank)
                with cut or contextlib.nullcontext(), around:
                    out = chunk(*inputs)
                if self.cp > 1 and self.groups.is_last_stage:
                    out = gather_positions(out, self.groups.cp_group)
            else:
                te = self.packing.te
                args, kwargs = packed_model_inputs(row, te=te)
                rope = contextlib.nullcontext() if te else per_sequence_rope(self.model, row)
                with rope, self.features.around_forward(micro, lead=0, trail=row.num_pad):
                    out = chunk(*args, **kwargs)

            def loss_func(output: torch.Tensor):
                return extract(output[:, strip:] if strip else output, micro)

            return out, loss_func

        return step

    @contextlib.contextmanager
    def _output_positions(self, start: int, stop: int):
        """While open, the output layer sees only sequence positions [start, stop) of its input
        (megatron's hidden states are [S, B, H]); nothing on stages without the output layer.
        Under sequence parallelism, whose hidden states reach the layer split along S, the
        hook gathers them first and the layer runs on the slice as without it (its input
        gradient then all-reduced over TP, of which the gather's backward keeps this rank's part)."""
        layer = getattr(self.model, "output_layer", None)
        if layer is None:
            yield
            return
        split = getattr(layer, "sequence_parallel", False)

        def keep(module, args, kwargs):
            hidden = args[0]
            if split:
                hidden = gather_sequence(hidden, self.groups.tp_group)
                module.sequence_parallel = False
            return (hidden[start:stop], *args[1:]), kwargs

        def restore(module, _args, _output):
            if split:
                module.sequence_parallel = True

        handles = [
            layer.register_forward_pre_hook(keep, with_kwargs=True),
            layer.register_forward_hook(restore),
        ]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            if split:  # also after a forward that raised
                layer.sequence_parallel = True

    def response_slice(self, output: torch.Tensor, micro: DataBatch) -> torch.Tensor:
        """[B, R, ...]: the outputs that predict (or value) the response tokens."""
        if PACKED in micro.info:
            return unpack_response(output, micro.info[PACKED])
        R = micro["response_mask"].shape[1]
        T = micro["input_ids"].shape[1]
        if output.shape[1] == R:  # the output layer ran on those positions only
            return output
        return output[:, T - R - 1 : T - 1]


def last_token_outputs(output_BT: torch.Tensor, micro: DataBatch, last_B: torch.Tensor) -> torch.Tensor:
    """[B, ...]: the output at each sequence's last real token, `last_B` its column in the padded
    layout (a packed micro-batch's output is one row [1, N, ...]: sequence s ends at column
    cu_seqlens[s + 1] - 1)."""
    row = micro.info.get(PACKED)
    if row is not None:
        return output_BT[0, row.cu_seqlens[1:].long().to(output_BT.device) - 1]
    rows = torch.arange(output_BT.shape[0], device=output_BT.device)
    return output_BT[rows, last_B.to(output_BT.device)]
