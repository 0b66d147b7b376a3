"""The reward-model training job's config: a recipe with a top-level `job: reward_model`
(`rl3d.controller.rm_train`; the loader reads such a recipe as an `RMJobConfig`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from rl3d.config.errors import FieldError
from rl3d.config.schema import (
    LaunchConfig,
    LoggingConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    TrainerConfig,
)

RM_JOB = "reward_model"  # the `job:` value of a reward-model training recipe


@dataclass(frozen=True, kw_only=True)
class SyntheticPreferenceConfig:
    rule: str = "parity_repeat"  # a rule of rl3d.data.preferences.PREFERENCE_RULES
    num_pairs: int = 4000
    seed: int = 0

    def __post_init__(self) -> None:
        from rl3d.data.preferences import get_preference_rule

        if self.num_pairs <= 0:
            raise FieldError("num_pairs", f"must be > 0, got {self.num_pairs}")
        try:
            get_preference_rule(self.rule)
        except ValueError as err:
            raise FieldError("rule", str(err)) from None


@dataclass(frozen=True, kw_only=True)
class PreferenceDataConfig:
    """Preference pairs: parquet with columns prompt, chosen, rejected (and, for a cost model,
    chosen_safe / rejected_safe), or a synthetic rule written to parquet in the run directory."""

    train_files: list[str] = field(default_factory=list)
    val_files: list[str] = field(default_factory=list)  # empty: hold out val_fraction of train
    synthetic: SyntheticPreferenceConfig | None = None  # used when train_files is empty
    val_fraction: float = 0.1
    tokenizer: str | None = None  # HF tokenizer dir; None = the model's, or the synthetic vocab
    max_length: int = 64  # prompt + response tokens; longer pairs are dropped (counted)

    def __post_init__(self) -> None:
        if not self.train_files and self.synthetic is None:
            raise FieldError("train_files", "give parquet files, or a data.synthetic block")
        if not 0 < self.val_fraction < 1:
            raise FieldError("val_fraction", f"must be in (0, 1), got {self.val_fraction}")
        if self.max_length <= 0:
            raise FieldError("max_length", f"must be > 0, got {self.max_length}")


@dataclass(frozen=True, kw_only=True)
class RMTrainConfig:
    # reward: -logsigmoid(r_chosen - r_rejected). cost (Safe-RLHF's cost model): the rejected
    # (less safe) response costs more, -logsigmoid(c_rejected - c_chosen), plus, where the data
    # labels responses safe/unsafe, -logsigmoid(s * c) with s = +1 unsafe, -1 safe, so that a
    # cost above 0 means unsafe (Safe-RLHF's threshold d = 0)
    objective: Literal["reward", "cost"] = "reward"
    batch_size: int = 64  # pairs per optimizer step, over all DP ranks
    micro_batch_size: int = 16  # pairs per forward/backward on one DP rank
    eval_every: int = 50  # steps; the held-out split is also scored at the last step
    eval_micro_batch_size: int = 64  # pairs

    def __post_init__(self) -> None:
        for name in ("batch_size", "micro_batch_size", "eval_every", "eval_micro_batch_size"):
            if getattr(self, name) <= 0:
                raise FieldError(name, f"must be > 0, got {getattr(self, name)}")


@dataclass(frozen=True, kw_only=True)
class RMJobConfig:
    """A reward-model training recipe (`job: reward_model`)."""

    job: Literal["reward_model"]
    model: ModelConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-3))
    data: PreferenceDataConfig
    rm: RMTrainConfig = field(default_factory=RMTrainConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    keep_last: int = 1  # checkpoints kept (one is written, at the last step)
    description: str = ""


def check_rm_job(cfg: RMJobConfig, fail) -> None:
    """What spans sections: layout against the model and the world, batches against DP."""
    from rl3d.models.spec import spec_of

    try:
        spec = spec_of(cfg.model)
    except ValueError as err:
        raise fail("model.hf_path", str(err)) from None
    par = cfg.parallel
    if spec.num_query_groups % par.tp:
        raise fail("parallel.tp", f"tp={par.tp} must divide the model's {spec.num_query_groups} KV heads")
    if spec.num_layers % par.pp:
        raise fail("parallel.pp", f"pp={par.pp} must divide the model's {spec.num_layers} layers")
    if par.cp > 1:
        raise fail(
            "parallel.cp", f"cp={par.cp}: the reward-model job does not train under context parallelism"
        )
    if cfg.launch.world_size != par.world_size:
        raise fail(
            "launch.nproc_per_node",
            f"world size {cfg.launch.world_size} does not match parallel tp*pp*dp = {par.world_size}",
        )
    if cfg.launch.backend != "spmd":
        raise fail("launch.backend", "the reward-model job runs under torchrun: use spmd")
    rm = cfg.rm
    if rm.batch_size % (par.dp * rm.micro_batch_size):
        raise fail(
            "rm.batch_size",
            f"{rm.batch_size} pairs must split over dp={par.dp} ranks in micro-batches of "
            f"{rm.micro_batch_size} (a multiple of {par.dp * rm.micro_batch_size})",
        )
    if cfg.data.max_length > spec.max_position_embeddings:
        raise fail("data.max_length", f"exceeds {spec.name}'s {spec.max_position_embeddings} positions")
