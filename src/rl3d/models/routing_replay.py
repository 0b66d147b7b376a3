"""Routing replay: a mixture of experts' forwards route each token by a record instead of by
their own router (`algorithm.routing_replay`), through megatron-core's `RouterReplay`.

The record is a batch field `routing` [B, T, layers, top_k] aligned with `input_ids` (the
rollout engine's, or the old-log-prob forward's own). Padded micro-batches hand megatron their
tokens sequence-major (token t of sample b is row t * B + b); packed ones, each sample's real
tokens in turn. Each pipeline stage replays its own layers. Padding slots without a recorded
set (zeros) route to experts 0 .. k-1 (their outputs are never read).

While replaying, every MoE layer also computes its own top-k (one `topk` over the logits it has)
and counts the decisions (token x layer, real tokens) whose expert set differs from the record:
per sample, `routing_differ` of `routing_decisions`.

Under sequence parallelism each TP rank's routers see a contiguous 1/t of a forward's tokens
(its sequence positions, megatron's order): each replays its part of the record, and the TP
ranks' records and counts are gathered back into the whole forward's.

Recompute of activations in the backward (`actor.recompute: full`) would call the routers
again outside a micro-batch's forward, so it is refused with replay (`rl3d.config.routing_replay`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

from rl3d.models.packing import PACKED
from rl3d.models.sequence_parallel import gather_tokens, token_shard
from rl3d.single_controller.batch import ROUTING, ROUTING_DECISIONS, ROUTING_DIFFER, DataBatch

ROW = "_replay_row"  # a session's row index of each sample, so packing may regroup them


class LayerReplay(RouterReplay):
    """megatron's replay of one MoE layer, held by its model alone: `RouterReplay.__init__`
    registers every instance in one process-wide list, which would mix the routers of the
    several models (actor, reference, critic) a process may hold."""

    def __init__(self) -> None:
        self.target_topk_idx = None
        self.recorded_topk_idx = None
        self.router_replay_action = None
        self.replay_backward_list = []
        self.differ_N: torch.Tensor | None = None  # the last replayed forward's own-vs-record

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        if self.router_replay_action == RouterReplayAction.REPLAY_FORWARD:
            with torch.no_grad():
                _, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
                target = self.target_topk_idx.to(own.device)
                self.differ_N = (own.sort(-1).values != target.sort(-1).values).any(-1)
        return super().get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)


def token_routing(
    routing_BTLK: torch.Tensor, micro: DataBatch, top_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A micro-batch's record in megatron's token order: ids [N, layers, k] int64 and which
    of the N slots are real tokens [N] bool (padding slots without a recorded set get experts
    0 .. k-1)."""
    real_BT = micro["attention_mask"].bool()
    if PACKED in micro.info:
        ids = routing_BTLK[real_BT].long()
        pad = micro.info[PACKED].num_pad  # pad tokens after the sequences get experts 0 .. k-1
        pads = torch.arange(top_k, device=ids.device).expand(pad, ids.shape[1], top_k)
        real_N = torch.arange(ids.shape[0] + pad, device=ids.device) < ids.shape[0]
        return torch.cat([ids, pads]), real_N
    B, T = real_BT.shape
    ids = routing_BTLK.transpose(0, 1).reshape(T * B, *routing_BTLK.shape[2:]).long()
    real_N = real_BT.t().reshape(-1)
    # a padding slot keeps a recorded set (its tokens then meet the same others in each expert's
    # matmul, so the real tokens round alike); one filled with zeros gets k distinct experts
    repeated = (ids.sort(-1).values.diff(dim=-1) == 0).any(-1)
    ids[repeated & ~real_N[:, None]] = torch.arange(top_k, device=ids.device)
    return ids, real_N


def per_sample(values_N: torch.Tensor, micro: DataBatch) -> torch.Tensor:
    """[B] sums of a per-slot value over each sample's real tokens."""
    real_BT = micro["attention_mask"].bool()
    B, T = real_BT.shape
    if PACKED in micro.info:
        sample_N = torch.repeat_interleave(torch.arange(B, device=real_BT.device), real_BT.sum(1))
        values_N = values_N[: sample_N.shape[0]]  # not the pad tokens after the sequences
        return torch.zeros(B, dtype=values_N.dtype, device=values_N.device).index_add_(0, sample_N, values_N)
    return (values_N.view(T, B) * real_BT.t()).sum(0)


class RoutingReplay:
    """The replay of one model's MoE layers on this rank (this pipeline stage's layers)."""

    def __init__(self, model: Any, spec: Any, groups: Any) -> None:
        self.spec, self.groups = spec, groups
        self.tp_split = bool(model.config.sequence_parallel)  # each TP rank routes its sequence part
        self.layers: dict[int, LayerReplay] = {}  # global layer index -> its replay
        for layer in model.decoder.layers:
            router = getattr(layer.mlp, "router", None)
            if router is not None:
                router.router_replay = self.layers.setdefault(layer.layer_number - 1, LayerReplay())
        self._session: dict[str, torch.Tensor] | None = None
        self.result = DataBatch()  # the last session's, per sample

    @contextlib.contextmanager
    def session(self, batch: DataBatch, *, record: bool = False) -> Iterator[DataBatch]:
        """Forwards over `batch` (the yielded batch, rows numbered) replay its `routing` when it
        has one, else record their own when `record`. After it, `result` holds per sample the
        record (`routing`, when recording) or the mismatch counts (when replaying), the same on
        every pipeline stage (collective over the stage group)."""
        B, T = batch["input_ids"].shape
        dev = self.groups.device
        state = {ROUTING_DIFFER: torch.zeros(B, device=dev), ROUTING_DECISIONS: torch.zeros(B, device=dev)}
        replaying = ROUTING in batch
        if record and not replaying:
            shape = (B, T, self.spec.num_layers, self.spec.moe_top_k)
            state[ROUTING] = torch.zeros(shape, dtype=torch.int32, device=dev)
        self._session = state if (replaying or record) else None
        try:
            yield batch.union(DataBatch({ROW: torch.arange(B)}))
        finally:
            self._session = None
        if not (replaying or record):
            self.result = DataBatch()
            return
        if self.groups.layout.p > 1:
            for value in state.values():
                dist.all_reduce(value, group=self.groups.pp_group)
        if ROUTING in state:
            self.result = DataBatch({ROUTING: state[ROUTING].to(torch.int16).cpu()})
        else:
            self.result = DataBatch({k: v.cpu() for k, v in state.items()})

    @contextlib.contextmanager
    def forward(self, micro: DataBatch) -> Iterator[None]:
        """Around one micro-batch's forward on this stage, inside a `session`."""
        state = self._session
        if state is None or not self.layers:
            yield
            return
        replaying = ROUTING in micro
        if replaying:
            ids_NLK, real_N = token_routing(micro[ROUTING], micro, self.spec.moe_top_k)
            mine_NLK = ids_NLK[self._shard(len(ids_NLK))]
        for index, layer in self.layers.items():
            if replaying:
                layer.set_target_indices(mine_NLK[:, index])
                layer.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
            else:
                layer.set_router_replay_action(RouterReplayAction.RECORD)
        try:
            yield
            rows = micro[ROW]
            if replaying:
                mine_N = sum(layer.differ_N.long() for layer in self.layers.values())
                differ_N = self._gathered(mine_N) * real_N
                state[ROUTING_DIFFER].index_add_(0, rows, per_sample(differ_N.float(), micro))
                decisions = per_sample(real_N.float(), micro) * len(self.layers)
                state[ROUTING_DECISIONS].index_add_(0, rows, decisions)
            else:
                T = state[ROUTING].shape[1]  # a padded micro-batch's leading SP pad columns dropped
                for index, layer in self.layers.items():
                    ids_NK = self._gathered(layer.get_recorded_indices())
                    state[ROUTING][rows, :, index] = self._sample_layout(ids_NK, micro)[:, -T:]
        finally:
            for layer in self.layers.values():
                layer.clear_indices()
                layer.clear_router_replay_action()
                layer.differ_N = None

    def _shard(self, num_tokens: int) -> slice:
        """The rows of a forward's token list this rank's routers see."""
        if not self.tp_split:
            return slice(0, num_tokens)
        return token_shard(num_tokens, self.groups.tp_rank, self.groups.layout.t)

    def _gathered(self, mine_N: torch.Tensor) -> torch.Tensor:
        """A forward's whole token list from the TP ranks' parts (collective over TP under
        sequence parallelism)."""
        if not self.tp_split:
            return mine_N
        return gather_tokens(mine_N, self.groups.tp_group, self.groups.layout.t)

    @staticmethod
    def _sample_layout(ids_NK: torch.Tensor, micro: DataBatch) -> torch.Tensor:
        """[N, k] in megatron's token order -> [B, T, k] aligned with the micro-batch's input_ids."""
        real_BT = micro["attention_mask"].bool()
        B, T = real_BT.shape
        ids_NK = ids_NK.to(torch.int32)
        if PACKED in micro.info:
            out = torch.zeros(B, T, ids_NK.shape[1], dtype=torch.int32, device=ids_NK.device)
            out[real_BT] = ids_NK[: micro.info[PACKED].num_real]
            return out
        return ids_NK.view(T, B, -1).transpose(0, 1)

    def mismatch(self, result: DataBatch) -> float:
        """The fraction of `result`'s decisions that differ, over the data-parallel group
        (collective over it)."""
        both = torch.stack([result[ROUTING_DIFFER].sum(), result[ROUTING_DECISIONS].sum()]).double()
        both = both.to(self.groups.device)
        dist.all_reduce(both, group=self.groups.dp_group)
        differ, decisions = both.tolist()
        return differ / decisions if decisions else 0.0
