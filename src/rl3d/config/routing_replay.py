"""`algorithm.routing_replay`: which routing a mixture of experts' trainer forwards use.

- `none` (default): each forward's own router chooses its experts.
- `rollout`: the rollout engine records every token's experts per layer (prompt and response)
  and the batch carries the record (`routing`) to the trainer, from a separate rollout pool too
  (in the rows it hands over): the old-log-prob forward, the reference when it is the actor's
  own frozen base (LoRA) and the update all route by it (megatron-core's `RouterReplay`). The
  trainer's log-probs then differ from the engine's by numerical precision alone, not by a
  token sent to other experts. With `rollout.async.max_staleness > 0` the record is the routing
  the tokens were sampled under, by weights up to that many versions behind the trainer's
  (with partial rollouts, each token's by the version that made it): the trainer routes as
  the sampler did, so the ratio and the rollout correction compare the same experts, while the
  weights' own gap remains. `moe/routing_mismatch` is the
  fraction of decisions (real token x layer) where the trainer's own router chose another
  expert set than the engine did, measured at the old-log-prob forward.
- `old`: the old-log-prob forward records its own routing and the update replays it, so the
  policy ratio compares the same experts as the policy changes over the step's mini-batches.

With either, `moe/routing_mismatch_update` is that fraction over the update's forwards (the
routers drift from the record as the optimizer steps). The checks here refuse the settings a
record cannot pass through yet, naming their key.
"""

from __future__ import annotations

from rl3d.config.roles import old_logp_source
from rl3d.config.schema import RL3DConfig


def check_routing_replay(cfg: RL3DConfig, fail) -> None:
    mode = cfg.algorithm.routing_replay
    if mode == "none":
        return
    from rl3d.models.spec import spec_of

    key = "algorithm.routing_replay"
    spec = spec_of(cfg.model)
    if not spec.is_moe:
        raise fail(key, f"{mode!r} replays a mixture of experts' routing; model {spec.name} is dense")
    if cfg.actor.recompute != "none":
        raise fail(
            "actor.recompute",
            f"{cfg.actor.recompute!r} reruns the routers in the backward, outside the replay; "
            f"with algorithm.routing_replay={mode!r} set it to none",
        )
    if mode == "old" and old_logp_source(cfg) != "recompute":
        raise fail(
            "actor.recompute_old_logp",
            "algorithm.routing_replay='old' records the routing in the old-log-prob forward, which "
            f"this recipe skips ({cfg.actor.recompute_old_logp!r}); set it to always",
        )
    if mode != "rollout":
        return
    ro = cfg.rollout
    if ro.engine != "torch":
        raise fail(
            "rollout.engine", "algorithm.routing_replay='rollout' needs the torch engine's routing record"
        )
    if ro.agent.enabled:
        raise fail(
            "rollout.agent.kind",
            "algorithm.routing_replay='rollout': a row of several engine calls has no one routing "
            "record; use algorithm.routing_replay='old'",
        )
