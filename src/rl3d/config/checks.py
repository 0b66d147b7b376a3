"""Checks that span components: layouts, world size, batch sizes.

They run on the typed config before any process group exists, and name the key and the file
that set it.
"""

from __future__ import annotations

from collections.abc import Callable

from rl3d.config.async_rollout import ROLLOUT_POOL, check_async_rollout
from rl3d.config.context_parallel import check_context_parallel
from rl3d.config.distill import check_teacher_layout
from rl3d.config.errors import ConfigError
from rl3d.config.gpu import check_gpu_path
from rl3d.config.lora import check_lora
from rl3d.config.reward_model import check_reward_models
from rl3d.config.roles import ACTOR, BUILT_IN_NAMES, role_spec
from rl3d.config.routing_replay import check_routing_replay
from rl3d.config.schema import RL3DConfig
from rl3d.config.tracking import check_trackers
from rl3d.config.validation import check_validation
from rl3d.config.warm_start import check_warm_start


def check_config(cfg: RL3DConfig, source_of: Callable[[str], str | None]) -> None:
    def fail(key: str, message: str) -> ConfigError:
        return ConfigError(message, key=key, source=source_of(key))

    check_async_rollout(cfg, fail)
    _check_layouts(cfg, fail)
    _check_batches(cfg, fail)
    _check_roles(cfg, fail)
    check_validation(cfg, fail)
    check_trackers(cfg, fail)
    check_warm_start(cfg, fail)
    check_lora(cfg, fail)
    check_routing_replay(cfg, fail)
    check_context_parallel(cfg, fail)


def _check_layouts(cfg: RL3DConfig, fail) -> None:
    from rl3d.config.pools import role_pools
    from rl3d.models.spec import spec_of
    from rl3d.parallel import GenerationLayout, ParallelLayout

    par = cfg.actor.parallel
    try:
        spec = spec_of(cfg.model)  # reads model.hf_path's config.json when model.name is unset
    except ValueError as err:
        raise fail("model.hf_path", str(err)) from None
    pools = role_pools(cfg)
    for pool in pools:  # each pool's layout is its role's `parallel` section
        t, p = pool.layout.t, pool.layout.p
        if pool.name == ROLLOUT_POOL:  # the separate generation pool: rollout.pool.tp
            section = "rollout.pool"
        else:
            section = ACTOR if pool.name == ACTOR else role_spec(cfg, pool.name).key
        if spec.num_query_groups % t:
            raise fail(
                f"{section}.tp" if pool.name == ROLLOUT_POOL else f"{section}.parallel.tp",
                f"tp={t} must divide the model's {spec.num_query_groups} KV heads ({spec.name})",
            )
        if spec.num_layers % p:
            raise fail(f"{section}.parallel.pp", f"pp={p} must divide the model's {spec.num_layers} layers")
        ep = pool.layout.ep
        if ep > 1 and not spec.is_moe:
            raise fail(
                f"{section}.parallel.ep", f"ep={ep}: {spec.name} is dense (no experts to split); use ep 1"
            )
        if spec.is_moe and spec.num_experts % ep:
            raise fail(
                f"{section}.parallel.ep",
                f"ep={ep} must divide the model's {spec.num_experts} experts ({spec.name})",
            )
        etp = pool.layout.etp
        if etp is not None and spec.moe_ffn_hidden_size % etp:
            raise fail(
                f"{section}.parallel.etp",
                f"etp={etp} must divide the experts' width {spec.moe_ffn_hidden_size} ({spec.name})",
            )
    if cfg.actor.moe.expert_bias_update_rate and not spec.moe_expert_bias:
        raise fail(
            f"{ACTOR}.moe.expert_bias_update_rate",
            f"{spec.name} has no router expert bias to update (a sigmoid router's, GLM-4.5's)",
        )
    _check_expert_tp_transition(cfg, fail)
    try:
        GenerationLayout.from_training(
            ParallelLayout(par.pp, par.tp, par.dp, cp=par.cp), cfg.rollout.t_g, cfg.rollout.p_g
        )
    except ValueError as err:
        key = "rollout.t_g" if "t_g" in str(err) else "rollout.p_g"
        raise fail(key, f"{err} (actor.parallel = tp {par.tp}, pp {par.pp}, dp {par.dp})") from None
    world = cfg.launch.world_size
    needed = sum(p.size for p in pools)
    if world != needed:
        what = " + ".join(
            f"{p.name} p*t*d = {p.layout.p}*{p.layout.t}*{p.layout.d} = {p.size}"
            if p.layout.cp == 1
            else f"{p.name} p*t*cp*d = {p.layout.p}*{p.layout.t}*{p.layout.cp}*{p.layout.d} = {p.size}"
            for p in pools
        )
        raise fail(
            "launch.nproc_per_node",
            f"world size nnodes*nproc_per_node = {cfg.launch.nnodes}*{cfg.launch.nproc_per_node} = "
            f"{world} does not match {what}",
        )
    if cfg.critic_enabled and cfg.critic.colocate:
        cp = cfg.critic.parallel
        if (cp.tp, cp.pp, cp.dp, cp.cp) != (par.tp, par.pp, par.dp, par.cp):
            raise fail(
                "critic.parallel",
                f"a colocated critic uses the actor's layout tp={par.tp} pp={par.pp} dp={par.dp} "
                f"cp={par.cp}, got tp={cp.tp} pp={cp.pp} dp={cp.dp} cp={cp.cp} "
                "(or set critic.colocate: false for its own pool)",
            )
    _check_sequence_parallel(cfg, spec, fail)


def _check_sequence_parallel(cfg: RL3DConfig, spec, fail) -> None:
    """megatron-core's MoE layer refuses a training forward at TP > 1 without sequence
    parallelism: a trained mixture of experts at tp > 1 must not turn it off; LoRA's adapters
    read whole sequences, so they do not run under it."""
    from rl3d.models.sequence_parallel import resolve_sequence_parallel

    trained = [("actor", cfg.actor.parallel)]
    if cfg.critic_enabled:  # a colocated critic has the actor's tp (checked above)
        trained.append(("critic", cfg.critic.parallel))
    for role, par in trained:
        if spec.is_moe and par.tp > 1 and par.sequence_parallel is False:
            raise fail(
                f"{role}.parallel.sequence_parallel",
                f"false: training a mixture of experts ({spec.name}) at {role}.parallel.tp={par.tp} "
                "needs sequence parallelism (megatron-core's MoE layer); use auto or true, or tp 1",
            )
    par = cfg.actor.parallel
    split = resolve_sequence_parallel(par.sequence_parallel, is_moe=spec.is_moe, tp=par.tp)
    if cfg.actor.lora is not None and split:
        raise fail(
            "actor.lora",
            f"does not run with sequence parallelism (actor.parallel.tp={par.tp}, "
            f"sequence_parallel={par.sequence_parallel}, {spec.name}): its adapters take "
            "the layers' inputs whole, not split along the sequence; use tp 1 (a mixture of "
            "experts: split the experts with actor.parallel.ep)",
        )


def _check_batches(cfg: RL3DConfig, fail) -> None:
    if cfg.algorithm.family.needs_group_samples and cfg.rollout.n < 2:
        raise fail("rollout.n", f"{cfg.algorithm.adv_estimator} compares samples of one prompt: needs n >= 2")
    samples = cfg.data.prompts_per_step * cfg.rollout.n
    if (cap := cfg.actor.log_prob_micro_batch_size) is not None and cap <= 0:
        raise fail("actor.log_prob_micro_batch_size", f"must be > 0 (or null: micro_batch_size), got {cap}")
    roles = [("actor", cfg.actor)]
    if cfg.critic_enabled:
        roles.append(("critic", cfg.critic))
    for role, rc in roles:
        dp = rc.parallel.dp
        if samples % rc.mini_batch_size:
            raise fail(
                f"{role}.mini_batch_size",
                f"{rc.mini_batch_size} must divide the step's samples: data.prompts_per_step * "
                f"rollout.n = {cfg.data.prompts_per_step} * {cfg.rollout.n} = {samples}",
            )
        if rc.mini_batch_size % (dp * rc.micro_batch_size):
            raise fail(
                f"{role}.micro_batch_size",
                f"mini_batch_size {rc.mini_batch_size} must split evenly over dp={dp} ranks in "
                f"micro-batches of {rc.micro_batch_size} (need a multiple of {dp * rc.micro_batch_size})",
            )
    if cfg.reference_enabled and not cfg.reference.colocate and samples % cfg.reference.parallel.dp:
        raise fail(
            "reference.parallel.dp",
            f"dp={cfg.reference.parallel.dp} must divide the step's {samples} samples "
            f"(data.prompts_per_step * rollout.n)",
        )


def _check_roles(cfg: RL3DConfig, fail) -> None:
    if cfg.hybrid_engine.strategy != "hybridflow":
        raise fail(
            "hybrid_engine.strategy",
            f"{cfg.hybrid_engine.strategy!r} is a baseline for `rl3d bench transition`; "
            "training runs reshard with 'hybridflow'",
        )
    if cfg.algorithm.overlong_buffer_length > cfg.rollout.max_new_tokens:
        raise fail(
            "algorithm.overlong_buffer_length",
            f"{cfg.algorithm.overlong_buffer_length} exceeds rollout.max_new_tokens = "
            f"{cfg.rollout.max_new_tokens}",
        )
    if cfg.algorithm.family.needs_cost_critic and not (cfg.reward.cost_fn or cfg.reward.cost_model):
        raise fail(
            "reward.cost_fn",
            f"{cfg.algorithm.adv_estimator!r} trains against a cost: name a cost function "
            "(built-in 'high_token_ids' for the synthetic tasks, or 'package.module:function')",
        )
    _check_reward_names(cfg, fail)
    check_reward_models(cfg, fail)
    check_teacher_layout(cfg, fail)
    for name in cfg.roles:
        if name in BUILT_IN_NAMES:
            raise fail(f"roles.{name}", f"{name!r} is a built-in role; name the recipe's own role otherwise")
    if cfg.algorithm.needs_critic and cfg.critic.enabled is False:
        raise fail("critic.enabled", f"advantage estimator {cfg.algorithm.adv_estimator!r} needs a critic")
    if cfg.algorithm.kl.coef > 0 and cfg.reference.enabled is False:
        raise fail("reference.enabled", "algorithm.kl.coef > 0 needs the reference model")
    if cfg.rollout.engine == "sglang" and cfg.launch.device == "cpu":
        raise fail("rollout.engine", "sglang needs CUDA; use rollout.engine=torch on CPU")
    check_gpu_path(cfg, fail)


def _check_reward_names(cfg: RL3DConfig, fail) -> None:
    """Built-in reward and cost names resolve now; user functions ("pkg.mod:fn") are imported
    by the reward worker, where the user's PYTHONPATH applies."""
    from rl3d.rewards.registry import resolve_cost_fn, resolve_reward_fn
    from rl3d.utils.imports import is_import_path

    checks = (("reward.fn", cfg.reward.fn, lambda: resolve_reward_fn(cfg.reward, cfg.data)),)
    if cfg.reward.fn_by_source is not None:  # resolves its built-in names and reward.fn's
        checks = (("reward.fn_by_source", "by source", lambda: resolve_reward_fn(cfg.reward, cfg.data)),)
    checks += (("reward.cost_fn", cfg.reward.cost_fn, lambda: resolve_cost_fn(cfg.reward)),)
    for key, name, resolve in checks:
        if name is None or is_import_path(name):
            continue
        try:
            resolve()
        except ValueError as err:  # "reward.fn_by_source.openai/gsm8k: unknown reward ..."
            where, sep, message = str(err).partition(": ")
            if not (sep and where.startswith(key)):
                where, message = key, str(err)
            raise fail(where, message) from None


def _check_expert_tp_transition(cfg: RL3DConfig, fail) -> None:
    """What the 3D-HybridEngine plans for experts trained at an expert TP apart from TP: a
    colocated engine under hybridflow (each expert gathered whole at t_g = 1, its generation
    TP shard's parts moved point to point at t_g > 1)."""
    par = cfg.actor.parallel
    if par.etp is None or par.etp == par.tp:
        return
    where = f"actor.parallel.etp={par.etp} (apart from tp={par.tp})"
    if cfg.rollout.placement != "colocated":
        raise fail("rollout.placement", f"{where}: a separate rollout pool is not planned; use colocated")
    if cfg.hybrid_engine.strategy != "hybridflow":
        raise fail(
            "hybrid_engine.strategy", f"{cfg.hybrid_engine.strategy}: {where} is planned by hybridflow only"
        )
