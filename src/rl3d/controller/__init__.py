"""The single controller: the RL loop (`RLTrainer`) over the role table, assembled the same way
for both worker-group backends (`assemble_trainer`), built once per (config, backend) by
`build_run`."""

from rl3d.utils.imports import lazy_attributes

_LAZY = {
    "RLTrainer": "rl3d.controller.trainer",
    "RoleGroups": "rl3d.controller.assemble",
    "assemble_trainer": "rl3d.controller.assemble",
    "build_run": "rl3d.controller.build",
}

__all__ = list(_LAZY)

__getattr__ = lazy_attributes(__name__, _LAZY)
