"""How a mixture of experts' router spreads the tokens of a training step over the experts.

`ExpertLoad(model, spec, groups)` hooks every MoE layer's router on this rank; each forward adds
the tokens routed to each expert (megatron's routing map: token x expert, top-k per token).
Padding slots of a padded micro-batch are routed too and counted; the pads that sequence
parallelism adds to make a length divisible by TP are not (`excluding`), so the metrics are the
same at every TP size. `collect(groups)` sums the counts of the data-parallel replicas, the
pipeline stages and, under sequence parallelism, the TP ranks (each routes its part of the
sequence; without it each routes the same tokens, so only TP rank 0 counts), and returns the
step's metrics, identical on every rank:

    moe/load_max_over_mean          the busiest expert's tokens over the mean, worst layer
    moe/layer_{i}/load_max_over_mean  the same for global layer i (1 = perfectly balanced)
    moe/dropped_tokens              routed slots short of top_k per token: 0 without a capacity
    moe/expert_bias_abs_max         a sigmoid router's largest |expert bias| after the step, over
                                    all layers (GLM-4.5; moves by `<role>.moe.expert_bias_update_rate`)

The counts are the routing map's, so they read the same for a softmax or a sigmoid router (the
bias steers which experts a token gets, and the map records that choice).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from rl3d.models.spec import ModelSpec


class ExpertLoad:
    def __init__(self, model: Any, spec: ModelSpec, groups: Any) -> None:
        self.spec = spec
        self.tp_split = bool(model.config.sequence_parallel)
        self.tp, self.tp_rank = groups.layout.t, groups.tp_rank
        self._pads = (0, 0)  # the current forward's uncounted leading and trailing token rows
        self.counts_LE = torch.zeros(spec.num_layers, spec.num_experts, dtype=torch.float64)
        self.slots = torch.zeros(spec.num_layers, dtype=torch.float64)  # tokens x top_k routed to
        self._handles = []
        self._biases = []  # this rank's routers' expert biases (a sigmoid router's)
        for layer in model.decoder.layers:
            router = getattr(layer.mlp, "router", None)
            if router is not None:
                self._handles.append(router.register_forward_hook(self._hook(layer.layer_number - 1)))
                if getattr(router, "expert_bias", None) is not None:
                    self._biases.append(router.expert_bias)

    def _hook(self, index: int):
        def record(_module: Any, _args: Any, output: Any) -> None:
            _probs, routing_map = output
            routed = routing_map.detach().to("cpu", torch.float64)
            lead, trail = self._pads
            if lead or trail:  # rows of the whole forward's token list, of which this rank has a part
                rows = routed.shape[0]
                first = self.tp_rank * rows if self.tp_split else 0
                total = rows * self.tp if self.tp_split else rows
                row_N = torch.arange(first, first + rows)
                routed = routed[(row_N >= lead) & (row_N < total - trail)]
            self.counts_LE[index] += routed.sum(0)
            self.slots[index] += routed.shape[0] * self.spec.moe_top_k

        return record

    @contextlib.contextmanager
    def excluding(self, lead: int, trail: int) -> Iterator[None]:
        """Around a forward whose first `lead` and last `trail` tokens (megatron's order, the
        whole forward's) are not counted."""
        self._pads = (lead, trail)
        try:
            yield
        finally:
            self._pads = (0, 0)

    def reset(self) -> None:
        self.counts_LE.zero_()
        self.slots.zero_()

    def collect(self, groups: Any) -> dict[str, float]:
        """The metrics of everything routed since `reset` (collective over the replica's ranks
        and the data-parallel group)."""
        both = torch.cat([self.counts_LE, self.slots[:, None]], dim=1)
        if groups.tp_rank != 0 and not self.tp_split:
            both.zero_()
        both = both.to(groups.device)
        dist.all_reduce(both, group=groups.dp_group)
        dist.all_reduce(both, group=groups.mp_group)
        both = both.cpu()
        counts_LE, slots = both[:, :-1], both[:, -1]
        mean = counts_LE.mean(1).clamp(min=1e-12)
        ratio = counts_LE.max(1).values / mean
        out = {f"moe/layer_{i}/load_max_over_mean": float(ratio[i]) for i in range(self.spec.num_layers)}
        out["moe/load_max_over_mean"] = float(ratio.max())
        out["moe/dropped_tokens"] = float((slots - counts_LE.sum(1)).sum())
        if self.spec.moe_expert_bias:  # every stage joins, with or without a MoE layer of its own
            biggest = max((float(b.abs().max()) for b in self._biases), default=0.0)
            top = torch.tensor([biggest], dtype=torch.float64, device=groups.device)
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=groups.mp_group)
            out["moe/expert_bias_abs_max"] = float(top)
        return out

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
