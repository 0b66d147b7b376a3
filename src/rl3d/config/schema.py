"""Typed component configs: one small frozen dataclass per component.

Each checks its own fields in `__post_init__` (raising `FieldError` with the field's name); the
checks that span components (layouts, batch sizes, world size) live in `rl3d.config.checks`.

Batch-size semantics (all counts are global, over all data-parallel ranks):
- `data.prompts_per_step`: prompts drawn per RL step.
- `rollout.n`: responses sampled per prompt, so a step has `prompts_per_step * n` samples.
- `actor.mini_batch_size` / `critic.mini_batch_size`: samples per optimizer step; a step's
  samples split into `prompts_per_step * n / mini_batch_size` optimizer steps per PPO epoch.
- `actor.micro_batch_size`: samples per forward/backward on ONE data-parallel rank; gradient
  accumulation runs `mini_batch_size / (dp * micro_batch_size)` micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal

from rl3d.config.agent import AgentConfig
from rl3d.config.async_rollout import AsyncRolloutConfig, Placement, RolloutPoolConfig, WeightUpdate
from rl3d.config.data import DataConfig, SyntheticDataConfig  # noqa: F401 - their home before config.data
from rl3d.config.distill import DistillConfig, check_distill
from rl3d.config.errors import FieldError
from rl3d.config.lora import LoraConfig
from rl3d.config.megatron import MegatronConfig
from rl3d.config.moe import MoeConfig
from rl3d.config.parallel import ParallelConfig
from rl3d.config.policy_loss import PolicyLossParams, check_policy_loss
from rl3d.config.reward_model import RewardModelConfig
from rl3d.config.sglang import SGLangConfig
from rl3d.config.slurm import SlurmConfig
from rl3d.config.validation import ValidationFields
from rl3d.config.warm_start import WarmStartConfig


def _positive(obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if value is not None and value <= 0:
            raise FieldError(name, f"must be > 0, got {value}")


def _non_negative(obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if value is not None and value < 0:
            raise FieldError(name, f"must be >= 0, got {value}")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    # A spec name from rl3d.models.MODEL_SPECS (shapes), e.g. tiny-llama, llama2-70b; None: the
    # shapes come from hf_path's config.json (rl3d.models.spec.spec_of). With both, they must agree.
    name: str | None = None
    # HF directory with weights + tokenizer, or a known model's name (rl3d.models.hub, e.g.
    # smollm2-135m) that resolves to its fetched directory; None = random init.
    hf_path: str | None = None
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"

    def __post_init__(self) -> None:
        from rl3d.models.hub import resolve_model_path
        from rl3d.models.spec import get_model_spec

        if self.hf_path:
            try:
                object.__setattr__(self, "hf_path", resolve_model_path(str(self.hf_path)))
            except ValueError as err:
                raise FieldError("hf_path", str(err)) from None
        if self.name is None:
            if not self.hf_path:
                raise FieldError("name", "missing required key (or set model.hf_path, an HF directory)")
            return
        try:
            get_model_spec(self.name)
        except ValueError as err:
            raise FieldError("name", str(err)) from None

    @property
    def label(self) -> str:
        """What to call the model in logs and manifests: its spec name, else its HF directory."""
        return self.name or str(self.hf_path)


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    lr: float = 1e-6
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    lr_warmup_steps: int = 0
    lr_schedule: Literal["constant", "cosine"] = "constant"
    distributed_optimizer: bool = False

    def __post_init__(self) -> None:
        _positive(self, "lr", "adam_eps")
        _non_negative(self, "weight_decay", "clip_grad", "lr_warmup_steps")


# What a role may move to host memory while the rollout engine generates (`<role>.offload`)
OffloadKind = Literal["params", "grads", "optimizer"]


def _unique(obj: Any, name: str) -> None:
    if len(set(values := getattr(obj, name))) != len(values):
        raise FieldError(name, f"lists an entry twice: {values}")


def _budget_needs_packing(cfg: Any) -> None:
    if cfg.max_tokens_per_micro_batch is not None and cfg.packing is False:
        raise FieldError("max_tokens_per_micro_batch", "needs packing: true")


@dataclass(frozen=True, kw_only=True)
class TrainedRoleConfig:
    """What the actor and the critic share: a layout, an optimizer and PPO's batch loop."""

    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    ppo_epochs: int = 1
    mini_batch_size: int = 8
    micro_batch_size: int = 1
    recompute: Literal["none", "full"] = "none"  # full: layers rerun forward in backward (docs/memory.md)
    # Sequence packing: each micro-batch's sequences run as one row without pad tokens (same
    # outputs within fp32 rounding, not bit for bit, hence off by default).
    packing: bool = False
    # With packing: micro-batches formed by a token budget (real tokens) instead of
    # micro_batch_size sequences; None = by micro_batch_size.
    max_tokens_per_micro_batch: int | None = None
    # In host memory (pinned on CUDA) while the colocated engine generates, back bit for bit
    # (rl3d.models.offload): params, grads (DDP's buffer), optimizer (fp32 masters, Adam states)
    offload: list[OffloadKind] = field(default_factory=list)
    moe: MoeConfig = field(default_factory=MoeConfig)  # router losses (rl3d.config.moe)
    megatron: MegatronConfig = field(default_factory=MegatronConfig)  # fused paths (rl3d.config.megatron)

    def __post_init__(self) -> None:
        _positive(self, "ppo_epochs", "mini_batch_size", "micro_batch_size", "max_tokens_per_micro_batch")
        _budget_needs_packing(self)
        _unique(self, "offload")


@dataclass(frozen=True, kw_only=True)
class ActorConfig(TrainedRoleConfig):
    # The old log-probs' forward: `auto` skips it when a step makes exactly one optimizer update
    # over its samples (ppo_epochs 1, one mini-batch) and nothing else reads them before the
    # update (no KL in the reward): pi_old is then the policy being updated, and the loss uses
    # its own detached log-probs.
    recompute_old_logp: Literal["auto", "always", "never"] = "auto"
    # Forward-only micro-batches (old, reference, teacher log-probs): at most this many samples
    log_prob_micro_batch_size: int | None = None  # None: micro_batch_size (engine.forward_micro_batch)
    warm_start: WarmStartConfig | None = None  # SFT on demonstrations before RL (rl3d.config.warm_start)
    lora: LoraConfig | None = None  # adapters over a frozen base (rl3d.config.lora)


@dataclass(frozen=True, kw_only=True)
class CriticConfig(TrainedRoleConfig):
    # None = decided by the algorithm (GAE needs a critic, the GRPO family does not).
    enabled: bool | None = None
    # True: on the actor's ranks, in the actor's layout. False: its own resource pool of
    # parallel.tp * pp * dp ranks after the actor's, in its own layout.
    colocate: bool = True
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))


@dataclass(frozen=True, kw_only=True)
class ReferenceConfig:
    # None = enabled exactly when a KL term is used (algorithm.kl.coef > 0).
    enabled: bool | None = None
    colocate: bool = True  # False: its own pool of parallel.tp * pp * dp ranks (layout `parallel`)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)  # used when colocate is False
    # As the actor's (micro-batches are the actor's); None = the actor's setting.
    packing: bool | None = None
    max_tokens_per_micro_batch: int | None = None
    offload: list[OffloadKind] = field(default_factory=list)  # as the actor's; params only (frozen)

    def __post_init__(self) -> None:
        _positive(self, "max_tokens_per_micro_batch")
        _budget_needs_packing(self)
        _unique(self, "offload")
        if extra := [k for k in self.offload if k != "params"]:
            raise FieldError("offload", f"{extra}: the reference is frozen and holds params only")

    def batching_of(self, actor: ActorConfig) -> ReferenceConfig:
        """This section with the reference's micro-batching resolved: it runs the actor's
        micro-batches, so the actor's packing (and token budget) unless it sets its own."""
        packing = actor.packing if self.packing is None else self.packing
        budget = self.max_tokens_per_micro_batch
        if budget is None and packing:
            budget = actor.max_tokens_per_micro_batch
        return replace(self, packing=packing, max_tokens_per_micro_batch=budget)


@dataclass(frozen=True, kw_only=True)
class ExtraRoleConfig:
    """A role a recipe adds (`roles.<name>`): a worker class by import path, placed like the
    built-in roles and called at its stages of every step (`rl3d.config.roles`)."""

    worker: str  # "package.module:Class", built with (rl3d.workers.RoleContext, **options)
    compute: str | None = None  # method called on each step's batch; its output joins the batch
    update: str | None = None  # method called once advantages are in; its metrics are logged
    colocate: bool = True  # False: its own pool of parallel.tp * pp * dp ranks
    parallel: ParallelConfig = field(default_factory=ParallelConfig)  # used when colocate is False
    options: dict[str, Any] = field(default_factory=dict)  # keyword arguments for the worker

    def __post_init__(self) -> None:
        module, _, name = self.worker.partition(":")
        if not (module and name):
            raise FieldError("worker", f"{self.worker!r} is not an import path 'package.module:Class'")


@dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    engine: Literal["torch", "sglang"] = "torch"
    t_g: int = 1  # generation tensor-parallel size; must divide actor.parallel.tp
    p_g: int = 1  # generation pipeline size; must divide actor.parallel.pp
    n: int = 1  # samples per prompt
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 = off
    max_new_tokens: int = 64
    # Generation stops at these and, unless ignore_eos, at the model's end ids for text data
    # (generation_config.json's, config.json's and the tokenizer's: rl3d.rollout.stops)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # the rollout engine's weights and compute; None: the training dtype (model.dtype). A lower
    # precision than training makes the rollout-training mismatch that rollout_correction fixes
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    sglang: SGLangConfig = field(default_factory=SGLangConfig)
    # multi-turn: rl3d's tool loop or a user's agent program (rl3d.config.agent, rl3d.agents)
    agent: AgentConfig = field(default_factory=AgentConfig)
    placement: Placement = "colocated"  # or separate: its own pool (rl3d.config.async_rollout)
    pool: RolloutPoolConfig = field(default_factory=RolloutPoolConfig)
    async_: AsyncRolloutConfig = field(default_factory=AsyncRolloutConfig)  # YAML: `async`
    # a separate pool's sync: whole buckets or only changed elements (rl3d.weight_sync.delta)
    weight_update: WeightUpdate = "full"
    # a separate pool's failure containment (rl3d.config.async_rollout); timeout_s None: off
    timeout_s: float | None = None
    reissue: bool = True
    min_fraction: float = 1.0
    max_restarts: int = 0

    def __post_init__(self) -> None:
        _positive(self, "t_g", "p_g", "n", "max_new_tokens", "timeout_s")
        _non_negative(self, "max_restarts")
        if not 0 < self.min_fraction <= 1:
            raise FieldError("min_fraction", f"must be in (0, 1], got {self.min_fraction}")
        _non_negative(self, "temperature")
        if not 0 < self.top_p <= 1:
            raise FieldError("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise FieldError("top_k", f"must be -1 (off) or >= 1, got {self.top_k}")
        if self.agent.kind == "endpoint" and self.t_g > 1:
            # every rank of a generation-TP group must make the same generate calls; agents'
            # requests arrive in their own order on each rank
            raise FieldError("agent.fn", f"needs t_g 1 (one engine rank per endpoint), got t_g {self.t_g}")


@dataclass(frozen=True, kw_only=True)
class HybridEngineConfig:
    strategy: Literal["hybridflow", "hybridflow_v", "ds_chat", "openrlhf"] = "hybridflow"
    bucket_mb: float = 256.0
    verify: bool = False  # checksum every generation shard against a direct slice
    timeout_s: float = 300.0
    # Resharding kernel form: auto = CUDA extension, else Triton on GPU; torch reference on CPU.
    kernel_backend: Literal["auto", "torch", "triton", "cuda"] = "auto"

    def __post_init__(self) -> None:
        _positive(self, "bucket_mb", "timeout_s")


@dataclass(frozen=True, kw_only=True)
class KLConfig:
    coef: float = 0.0
    estimator: Literal["k1", "k2", "k3"] | None = None  # None: k1 in the reward, k3 in the loss
    # where the penalty applies: the reward (per token) or the loss; None: the family's default
    apply_to: Literal["reward", "loss"] | None = None
    controller: Literal["fixed", "adaptive"] = "fixed"
    target: float = 0.1  # adaptive controller's target KL
    horizon: int = 10000  # adaptive controller's horizon (samples)

    def __post_init__(self) -> None:
        _non_negative(self, "coef")
        _positive(self, "target", "horizon")


@dataclass(frozen=True, kw_only=True)
class RolloutCorrectionConfig:
    """Importance weights pi_old / pi_rollout between the trainer and the rollout engine
    (`rl3d.algos.rollout_correction`): tis | mis | seq_tis, truncated or masked at `threshold`."""

    mode: Literal["none", "tis", "mis", "seq_tis"] = "none"
    threshold: float = 2.0

    def __post_init__(self) -> None:
        if self.threshold <= 1.0:
            raise FieldError("threshold", f"must be > 1, got {self.threshold}")


@dataclass(frozen=True, kw_only=True)
class SafeRLHFConfig:
    """PPO-Lagrangian (Dai et al., ICLR 2024): max J_R - lambda * (J_C - d), lambda >= 0."""

    cost_threshold: float = 0.0  # d
    lagrange_init: float = 1.0
    lagrange_lr: float = 0.01
    lagrange_max: float | None = None

    def __post_init__(self) -> None:
        _positive(self, "lagrange_init", "lagrange_lr", "lagrange_max")


def _registered(registry_getter: str, field_name: str, value: str) -> None:
    import rl3d.algos as algos

    try:
        getattr(algos, registry_getter)(value)
    except ValueError as err:
        raise FieldError(field_name, str(err)) from None


@dataclass(frozen=True, kw_only=True)
class AlgorithmConfig:
    """Names resolve in the `rl3d.algos` registries; a new algorithm is an entry plus a recipe."""

    # gae | grpo | rloo | reinforce_plus_plus | remax | safe_rlhf | on_policy_distillation
    adv_estimator: str = "grpo"
    # ppo | dual_clip | clip_higher | gspo | gmpo | sapo | cispo | gpg | clip_cov | kl_cov (docs/losses.md)
    policy_loss: str = "ppo"
    gamma: float = 1.0
    lam: float = 1.0
    whiten_advantages: bool = True  # GAE / Safe-RLHF: whiten over the whole (DP) batch
    norm_adv_by_std: bool = True  # GRPO: divide by the group's std (Dr. GRPO sets false)
    clip_low: float | None = None  # None = the loss's preset (PPO: 0.2)
    clip_high: float | None = None  # None = the preset (PPO: clip_low); DAPO's clip-higher uses 0.28
    dual_clip_c: float | None = None  # dual-clip bound for negative advantages, e.g. 3.0
    loss_agg_mode: str = "token-mean"  # token-mean | seq-mean-token-sum | seq-mean-token-mean
    entropy_coef: float = 0.0
    value_clip_range: float | None = 0.2  # None = unclipped value loss
    kl: KLConfig = field(default_factory=KLConfig)
    dynamic_sampling: bool = False  # DAPO: drop groups whose rewards are all equal, then refill
    overlong_buffer_length: int = 0  # DAPO soft overlong penalty window in tokens; 0 = off
    overlong_penalty_factor: float = 1.0
    safe_rlhf: SafeRLHFConfig = field(default_factory=SafeRLHFConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    loss_params: PolicyLossParams = field(default_factory=PolicyLossParams)
    distill: DistillConfig = field(default_factory=DistillConfig)  # on_policy_distillation's teachers
    # a mixture of experts' trainer forwards route by a record: none | rollout (the engine's) |
    # old (the old-log-prob forward's own, replayed by the update); rl3d.config.routing_replay
    routing_replay: Literal["none", "rollout", "old"] = "none"

    def __post_init__(self) -> None:
        _registered("get_advantage_estimator", "adv_estimator", self.adv_estimator)
        _registered("get_policy_loss", "policy_loss", self.policy_loss)
        _registered("get_loss_agg_mode", "loss_agg_mode", self.loss_agg_mode)
        check_policy_loss(self)
        check_distill(self)
        _non_negative(self, "clip_low", "clip_high", "entropy_coef", "value_clip_range")
        _non_negative(self, "overlong_buffer_length", "overlong_penalty_factor")
        if not 0 <= self.gamma <= 1:
            raise FieldError("gamma", f"must be in [0, 1], got {self.gamma}")
        if not 0 <= self.lam <= 1:
            raise FieldError("lam", f"must be in [0, 1], got {self.lam}")
        if self.dual_clip_c is not None and self.dual_clip_c <= 1:
            raise FieldError("dual_clip_c", f"must be > 1, got {self.dual_clip_c}")

    @property
    def family(self):
        """The estimator's `rl3d.algos.AlgorithmFamily` (critic? groups? greedy baseline?)."""
        from rl3d.algos import get_advantage_estimator

        return get_advantage_estimator(self.adv_estimator)

    @property
    def needs_critic(self) -> bool:
        return self.family.needs_critic

    @property
    def kl_apply_to(self) -> str:
        return self.kl.apply_to or self.family.default_kl_apply_to

    @property
    def kl_estimator(self) -> str:
        return self.kl.estimator or ("k1" if self.kl_apply_to == "reward" else "k3")


@dataclass(frozen=True, kw_only=True)
class RewardConfig:
    fn: str = "synthetic"  # a built-in reward name, or a user function "package.module:function"
    # Route each row's reward by its data_source column: {source: reward name}, over the
    # built-in sources (rl3d.rewards.registry.SOURCE_REWARDS); other sources fall back to `fn`
    fn_by_source: dict[str, str] | None = None
    # A cost per response (higher = worse), named like `fn`: Safe-RLHF trains against it, the
    # other estimators only log it (cost/mean)
    cost_fn: str | None = None
    num_workers: int = 0  # >0 fans scoring out to CPU workers (Ray backend)
    on_error: Literal["stop", "skip"] = "stop"  # skip = score 0, report and count
    model: RewardModelConfig | None = None  # a learned reward model (rl3d.config.reward_model)
    cost_model: RewardModelConfig | None = None  # a learned cost model (Safe-RLHF)

    def __post_init__(self) -> None:
        _non_negative(self, "num_workers")


@dataclass(frozen=True, kw_only=True)
class TrainerConfig(ValidationFields):  # + the trainer.val_* keys (rl3d.config.validation)
    total_steps: int = 10
    seed: int = 1
    experiment: str = "rl3d"
    run_dir: str | None = None  # default: runs/<experiment>
    hooks: dict[str, str] = field(default_factory=dict)  # on_step_end: "pkg.mod:fn", ...

    def __post_init__(self) -> None:
        super().__post_init__()
        _positive(self, "total_steps")
        known = {"on_rollout_end", "on_step_end", "on_checkpoint"}
        for name in self.hooks:
            if name not in known:
                raise FieldError(f"hooks.{name}", f"unknown hook; known: {', '.join(sorted(known))}")


@dataclass(frozen=True, kw_only=True)
class LoggingConfig:
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    all_ranks: bool = False  # console output from every rank, not only rank 0
    jsonl: bool = True
    tensorboard: bool = True
    progress: bool = True
    trackers: list[str] | None = None  # tensorboard|wandb|mlflow; None: [tensorboard] (config.tracking)
    # decoded responses per step (and per validation) in samples.jsonl (rl3d.logging.samples); 0 = off
    samples: int = 4

    def __post_init__(self) -> None:
        _non_negative(self, "samples")


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    save_every: int = 0  # steps; 0 = never
    keep_last: int = 2
    resume: Literal["auto", "never"] = "auto"
    # Also write the actor as an HF directory (config.json, safetensors, tokenizer files) into
    # each checkpoint, at step_N/hf (rl3d.models.export); `rl3d export` does it afterwards.
    save_hf: bool = False

    def __post_init__(self) -> None:
        _non_negative(self, "save_every")
        _positive(self, "keep_last")


@dataclass(frozen=True, kw_only=True)
class LaunchConfig:
    backend: Literal["spmd", "ray"] = "spmd"
    nnodes: int = 1
    nproc_per_node: int = 1
    device: Literal["auto", "cpu", "cuda"] = "auto"
    ray_address: str | None = None
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    # The world's collectives (training, rollout) wait this long for the slowest rank; at scale
    # a long rollout outlasts the resharding's own `hybrid_engine.timeout_s`.
    timeout_s: float = 1800.0

    def __post_init__(self) -> None:
        _positive(self, "nnodes", "nproc_per_node", "timeout_s")

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node


@dataclass(frozen=True, kw_only=True)
class RL3DConfig:
    """A whole resolved recipe."""

    model: ModelConfig
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    hybrid_engine: HybridEngineConfig = field(default_factory=HybridEngineConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    data: DataConfig
    reward: RewardConfig = field(default_factory=RewardConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    roles: dict[str, ExtraRoleConfig] = field(default_factory=dict)  # a recipe's own roles
    description: str = ""

    @property
    def critic_enabled(self) -> bool:
        return self.algorithm.needs_critic if self.critic.enabled is None else self.critic.enabled

    @property
    def reference_enabled(self) -> bool:
        if self.reference.enabled is None:
            return self.algorithm.kl.coef > 0
        return self.reference.enabled
