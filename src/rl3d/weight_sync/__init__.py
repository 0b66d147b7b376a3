"""Weight sync for a separate rollout pool: the actor's training shards, sent after each update
to the rollout ranks and converted there into their generation layout.

The plan is the hybrid engine's (`rl3d.hybrid_engine.pool`: a transition whose destination
ranks are another pool's, pure, shapes only) and so is its executor (`rl3d.hybrid_engine.p2p`).
This package holds the transport between the two pools' worlds: `WeightBridge` (gloo on CPU,
NCCL on GPU), the training and rollout ends of a sync (`send_weights`, `receive_weights`), and
the delta encoding that sends only changed elements (`DeltaSender`, `DeltaReceiver`).
"""

from rl3d.weight_sync.delta import DeltaReceiver, DeltaSender
from rl3d.weight_sync.transfer import WeightBridge, receive_weights, send_weights

__all__ = ["DeltaReceiver", "DeltaSender", "WeightBridge", "receive_weights", "send_weights"]
