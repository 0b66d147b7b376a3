"""How a mixture of experts' router spreads the tokens of a training step over the experts.

`ExpertLoad(model, spec)` hooks every MoE layer's router on this rank; each forward adds the
tokens routed to each expert (megatron's routing map: token x expert, top-k per token). Padding
slots of a padded micro-batch are routed too and counted. `collect(groups)` sums the counts of
the data-parallel replicas and the pipeline stages (each TP rank routes the same tokens, so
only TP rank 0 counts) and returns the step's metrics, identical on every rank:

    moe/load_max_over_mean          the busiest expert's tokens over the mean, worst layer
    moe/layer_{i}/load_max_over_mean  the same for global layer i (1 = perfectly balanced)
    moe/dropped_tokens              routed slots short of top_k per token: 0 without a capacity
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from rl3d.models.spec import ModelSpec


class ExpertLoad:
    def __init__(self, model: Any, spec: ModelSpec) -> None:
        self.spec = spec
        self.counts_LE = torch.zeros(spec.num_layers, spec.num_experts, dtype=torch.float64)
        self.slots = torch.zeros(spec.num_layers, dtype=torch.float64)  # tokens x top_k routed to
        self._handles = []
        for layer in model.decoder.layers:
            router = getattr(layer.mlp, "router", None)
            if router is not None:
                self._handles.append(router.register_forward_hook(self._hook(layer.layer_number - 1)))

    def _hook(self, index: int):
        def record(_module: Any, _args: Any, output: Any) -> None:
            _probs, routing_map = output
            routed = routing_map.detach().to("cpu", torch.float64)
            self.counts_LE[index] += routed.sum(0)
            self.slots[index] += routed.shape[0] * self.spec.moe_top_k

        return record

    def reset(self) -> None:
        self.counts_LE.zero_()
        self.slots.zero_()

    def collect(self, groups: Any) -> dict[str, float]:
        """The metrics of everything routed since `reset` (collective over the replica's ranks
        and the data-parallel group)."""
        both = torch.cat([self.counts_LE, self.slots[:, None]], dim=1)
        if groups.tp_rank != 0:
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
        return out

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
