"""`trainer.val_*`: generation on held-out prompts during training (`rl3d.controller.validation`).

Every `val_every` steps (and after the last one) the actor answers the validation prompts
(`data.val_files`, or a synthetic split disjoint from the training prompts) once greedily and
`val_n` times sampled with the rollout's settings; the reward scores every response, and
`val/*` is logged with that step's metrics. pass@k is the unbiased estimate from `val_n`
samples per prompt, a sample passing when its score is at least `val_pass_threshold`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rl3d.config.errors import FieldError

SYNTHETIC_VAL_PROMPTS = 64  # a synthetic split's size when trainer.val_num_prompts is unset


@dataclass(frozen=True, kw_only=True)
class ValidationFields:
    """The `trainer.val_*` keys (`TrainerConfig` inherits them)."""

    val_every: int = 0  # steps between validations; 0 = off
    val_before_train: bool = False  # also validate the starting policy, logged as step 0
    val_pass_k: list[int] = field(default_factory=lambda: [1])
    # sampled responses per prompt; None: the smallest multiple of rollout.n >= max(val_pass_k)
    val_n: int | None = None
    # None: every row of data.val_files, or a synthetic split of SYNTHETIC_VAL_PROMPTS
    val_num_prompts: int | None = None
    val_pass_threshold: float = 1.0  # a sample passes when its rule score (reward.fn) >= this

    def __post_init__(self) -> None:
        if self.val_every < 0:
            raise FieldError("val_every", f"must be >= 0 (0 = off), got {self.val_every}")
        if not self.val_pass_k:
            raise FieldError("val_pass_k", "give at least one k, e.g. [1, 4]")
        for i, k in enumerate(self.val_pass_k):
            if k < 1:
                raise FieldError(f"val_pass_k[{i}]", f"must be >= 1, got {k}")
        for name in ("val_n", "val_num_prompts"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise FieldError(name, f"must be >= 1, got {value}")

    @property
    def validates(self) -> bool:
        return self.val_every > 0 or self.val_before_train


def validation_samples(cfg) -> int:
    """Sampled responses per validation prompt: `trainer.val_n`, or the smallest multiple of
    `rollout.n` that covers the largest k (each generate call gives rollout.n per prompt)."""
    if cfg.trainer.val_n is not None:
        return cfg.trainer.val_n
    n = cfg.rollout.n
    return n * -(-max(cfg.trainer.val_pass_k) // n)


def check_validation(cfg, fail) -> None:
    """Checks across sections (`cfg` is the whole `RL3DConfig`; `fail(key, message)` makes the
    `ConfigError`). They run before any process group starts."""
    from pathlib import Path

    tr, data = cfg.trainer, cfg.data
    for i, path in enumerate(data.val_files):
        if not Path(path).is_file():
            raise fail(f"data.val_files[{i}]", f"{path}: no such file")
    if not tr.validates:
        return
    if data.train_files and not data.val_files:
        raise fail(
            "trainer.val_every",
            "validation needs data.val_files (parquet like data.train_files); "
            "only synthetic data makes its own split",
        )
    n = validation_samples(cfg)
    if n % cfg.rollout.n:
        raise fail("trainer.val_n", f"must be a multiple of rollout.n = {cfg.rollout.n}, got {n}")
    if max(tr.val_pass_k) > n:
        raise fail("trainer.val_pass_k", f"pass@{max(tr.val_pass_k)} needs trainer.val_n >= it, got {n}")
