"""What a rank hands every role worker it builds: `Worker(RoleContext, **options)`.

The role table (`rl3d.config.roles`) names the worker class and its options; the assembly
(`rl3d.controller.rank`) builds one `RoleContext` per rank and passes it to every role that
rank hosts, rl3d's own and a recipe's alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rl3d.config import RL3DConfig
from rl3d.models.bootstrap import MegatronGroups
from rl3d.models.spec import ModelSpec


@dataclass(frozen=True)
class RoleContext:
    cfg: RL3DConfig
    spec: ModelSpec
    groups: MegatronGroups  # this rank's megatron grid (its pool's world)
    tokenizer: Any
    # where a role's network starts: the colocated actor's (a MegatronEngine, copied in memory),
    # else the weight directory at `init_path` (a role in its own pool)
    init_from: Any = None
    init_path: str | None = None

    @property
    def pad_token_id(self) -> int:
        from rl3d.data.tokenizer import pad_id_of

        return pad_id_of(self.tokenizer)
