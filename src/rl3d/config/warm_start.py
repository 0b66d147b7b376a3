"""`actor.warm_start`: supervised fine-tuning on demonstrations before RL (a cold start).

    actor:
      warm_start:
        data: rl3d.data.tool_task:tool_multiply_demonstrations   # or a .jsonl / .parquet file
        num_examples: 32      # demonstrations used (a function is asked for this many)
        steps: 40             # optimizer steps of SFT
        batch_size: 16        # demonstrations per step, over all DP ranks
        lr: 3.0e-3
        seed: 0               # which demonstrations a function makes, and their order
        options: {}           # more keyword arguments for the function

The actor trains on the demonstrations (token-mean NLL over the response tokens whose loss mask
is 1: observation tokens are context only, as in RL) through its own megatron model and
optimizer, in its own layout, before any other role copies it. RL then starts from the warmed
weights with a fresh optimizer state (`rl3d.controller.warm_start`). Off by default.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rl3d.config.errors import FieldError

FILE_SUFFIXES = (".jsonl", ".json", ".parquet")


@dataclass(frozen=True, kw_only=True)
class WarmStartConfig:
    data: str  # "package.module:function" (returns rows) or a .jsonl/.json/.parquet file of rows
    num_examples: int | None = None  # None: every row of the file (a function: its default)
    steps: int = 50
    batch_size: int = 16
    lr: float = 1e-3
    seed: int = 0
    options: dict[str, Any] = field(default_factory=dict)  # keyword arguments of the function

    def __post_init__(self) -> None:
        for key in ("steps", "batch_size", "lr", "num_examples"):
            value = getattr(self, key)
            if value is not None and value <= 0:
                raise FieldError(key, f"must be > 0, got {value}")
        if self.is_function:
            from rl3d.utils.imports import import_object

            try:
                import_object(self.data, what="demonstrations function")
            except ValueError as err:
                raise FieldError("data", str(err)) from None
        elif Path(self.data).suffix not in FILE_SUFFIXES:
            raise FieldError(
                "data",
                f"{self.data!r}: expected 'package.module:function' or a {'/'.join(FILE_SUFFIXES)} file",
            )
        elif not Path(self.data).is_file():
            raise FieldError("data", f"no such file: {self.data!r}")
        if self.options and not self.is_function:
            raise FieldError("options", "keyword arguments are for a demonstrations function, not a file")

    @property
    def is_function(self) -> bool:
        return ":" in self.data


def check_warm_start(cfg: Any, fail) -> None:
    """Cross-section check: every DP rank of the actor gets an equal share of a step's rows."""
    ws, dp = cfg.actor.warm_start, cfg.actor.parallel.dp
    if ws is not None and ws.batch_size % dp:
        raise fail(
            "actor.warm_start.batch_size", f"{ws.batch_size} must split evenly over actor dp={dp} ranks"
        )
