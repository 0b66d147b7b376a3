"""The single controller: the RL loop (`RLTrainer`) over the role table, assembled the same way
for both worker-group backends (`assemble_trainer`; `build_trainer` is the spmd entry)."""

from rl3d.utils.imports import lazy_attributes

_LAZY = {
    "RLTrainer": "rl3d.controller.trainer",
    "RoleGroups": "rl3d.controller.assemble",
    "assemble_trainer": "rl3d.controller.assemble",
    "build_trainer": "rl3d.controller.build",
}

__all__ = list(_LAZY)

__getattr__ = lazy_attributes(__name__, _LAZY)
