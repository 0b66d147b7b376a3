"""A toy role added by a recipe (`roles.toy`): a worker class and one table entry, nothing else.

It runs on the actor's ranks and megatron grid. Its compute stage adds a field to every step's
batch (a scaled response length, split over DP and collected like a megatron forward); its update
stage sees the finished batch (advantages included) and reports metrics.
"""

from rl3d.single_controller import DataBatch, Dispatch, DispatchInfo, register


class ResponseLengthWorker:
    def __init__(self, ctx, *, scale: float = 1.0):
        self.groups, self.scale, self.num_updates = ctx.groups, scale, 0

    def dispatch_info(self) -> DispatchInfo:
        g = self.groups
        return DispatchInfo(
            dp_rank=g.dp_rank, dp_size=g.layout.d, is_collector=g.tp_rank == 0 and g.is_last_stage
        )

    @register(Dispatch.MEGATRON_COMPUTE)
    def compute_length(self, batch: DataBatch) -> DataBatch:
        return DataBatch({"toy_length": batch["response_mask"].sum(-1).float() * self.scale})

    @register(Dispatch.MEGATRON_COMPUTE)
    def update_toy(self, batch: DataBatch) -> dict[str, float]:
        self.num_updates += 1
        return {
            "toy/length_mean": batch["toy_length"].mean().item(),
            "toy/updates": float(self.num_updates),
            "toy/saw_advantages": float("advantages" in batch),
            "toy/rows": float(len(batch)),
        }
