"""Weight sync for a separate rollout pool: the actor's training shards, sent after each update
to the rollout ranks and converted there into their generation layout.

`plan` is pure (shapes only): which training rank sends which shards to which rollout rank, in
which buckets, and how many bytes that is. `transfer` runs a plan over a process group that
spans both pools (`WeightBridge`: gloo on CPU, NCCL on GPU), counting the bytes it moves.
"""

from rl3d.weight_sync.plan import Piece, Route, SyncPlan, plan_weight_sync
from rl3d.weight_sync.transfer import SyncStats, WeightBridge, receive_weights, send_weights

__all__ = [
    "Piece",
    "Route",
    "SyncPlan",
    "SyncStats",
    "WeightBridge",
    "plan_weight_sync",
    "receive_weights",
    "send_weights",
]
