"""The role workers: one class per role, built as `Worker(RoleContext, **options)` from the role
table (`rl3d.config.roles`). The classes load on first use: they import megatron-core."""

from rl3d.utils.imports import lazy_attributes

_LAZY = {
    "ActorRolloutWorker": "rl3d.workers.roles",
    "CriticWorker": "rl3d.workers.roles",
    "ReferenceWorker": "rl3d.workers.roles",
    "RewardWorker": "rl3d.workers.roles",
    "RoleContext": "rl3d.workers.context",
}

__all__ = list(_LAZY)

__getattr__ = lazy_attributes(__name__, _LAZY)
