"""Assemble a run from its resolved config: process groups, workers, data, logging, checkpoints.

Two halves, shared by both worker-group backends:
- rank-local (`build_rank_workers`, `save_rank_files`, `load_rank_files`): the role workers of
  one rank and their checkpoint files. Under torchrun (spmd) every rank runs them; under Ray
  every rank's actor does.
- controller-side (`build_data`, `assemble_trainer`, `TrainerCheckpoints`): sampler, KL
  controller, metric sinks, hooks, progress and the checkpoint directory. Under spmd every
  rank runs them (rank 0 writes); under Ray the driver does.

The recipe was validated before any process group existed; this module turns it into the
objects `RLTrainer` drives. `build_trainer` is the spmd assembly; `rl3d.launch.ray_launch`
is the Ray one.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rl3d.config import LoadedConfig, RL3DConfig
from rl3d.config.pools import Pool, hosting, role_pools
from rl3d.controller.trainer import RLTrainer, Workers
from rl3d.single_controller.batch import PROMPT_WIDTH, DataBatch
from rl3d.single_controller.spmd import SPMDWorkerGroup, agree

logger = logging.getLogger(__name__)


class PromptBatches:
    """The sampler's prompts as DataBatches (identical on every rank: same seed)."""

    def __init__(self, sampler):
        self.sampler = sampler

    def next_batch(self) -> DataBatch:
        items = self.sampler.next_batch()
        return DataBatch(
            meta={
                "prompt_ids": [list(i.prompt_ids) for i in items],
                "prompt_text": [i.prompt_text for i in items],
                "answer": [i.answer for i in items],
                "source": [i.source for i in items],
                "index": [i.index for i in items],
            },
            info={PROMPT_WIDTH: max(len(i.prompt_ids) for i in items)},
        )


def tokenizer_path(cfg: RL3DConfig) -> str | None:
    """data.tokenizer, else the model's (text data only): synthetic tasks speak token ids."""
    return cfg.data.tokenizer or (cfg.model.hf_path if cfg.data.train_files else None)


# ---------------------------------------------------------------- rank-local


INIT_WEIGHTS = "init_weights"  # run_dir subfolder: the actor's initial weights, for other pools


@dataclass
class RankWorkers:
    """What one rank hosts: its pool, megatron groups, role workers by group name ("actor",
    "reference", "critic", "cost_critic") and the checkpointed megatron roles (the trained
    ones)."""

    groups: Any  # rl3d.models.bootstrap.MegatronGroups
    pool: Pool
    workers: dict[str, Any] = field(default_factory=dict)
    roles: dict[str, Any] = field(default_factory=dict)


def build_rank_workers(
    cfg: RL3DConfig,
    spec,
    groups,
    tokenizer,
    *,
    pools: list[Pool],
    pool: Pool,
    run_dir: Path,
    sync: Callable[[], Any] = lambda: None,
) -> RankWorkers:
    """The megatron role workers of this rank's pool (actor+rollout and the colocated roles, or
    one role in its own pool).

    Every role starts from the actor's initial network. A colocated one copies it in memory; one
    in its own pool (another world, maybe another layout) loads `model.hf_path`, else the
    actor's initial weights, which the actor's pool writes to `run_dir/init_weights` before
    `sync()` (a barrier across pools under spmd; under Ray the driver sets the actor's pool up
    first)."""
    from rl3d.workers.roles import ActorRolloutWorker, CriticWorker, ReferenceWorker

    rank = RankWorkers(groups, pool)
    init_dir = run_dir / INIT_WEIGHTS
    if pool.name == "actor":
        pad = getattr(tokenizer, "pad_token_id", None)
        actor = ActorRolloutWorker(cfg, spec, groups, pad_token_id=0 if pad is None else pad)
        rank.workers["actor"], rank.roles["actor"] = actor, actor.role
        if len(pools) > 1 and not cfg.model.hf_path:
            export_initial_weights(actor.role, init_dir)
        sync()
        init_from, init_path = actor.role, None
    else:
        sync()
        init_from, init_path = None, cfg.model.hf_path or str(init_dir)
    if "reference" in pool.roles:
        rank.workers["reference"] = ReferenceWorker(
            cfg, spec, groups, init_from=init_from, init_path=init_path
        )
    for name, kind in (("critic", "reward"), ("cost_critic", "cost")):
        if name in pool.roles:
            critic = CriticWorker(cfg, spec, groups, init_from=init_from, init_path=init_path, kind=kind)
            rank.workers[name], rank.roles[name] = critic, critic.role
    return rank


def export_initial_weights(role, dst: Path) -> None:
    """The actor's weights as a Megatron weight directory any layout loads (collective over the
    actor's world)."""
    from rl3d.models.hf_mapping import hf_config_from_spec
    from rl3d.models.weights import save_weights

    save_weights(role.model, role.spec, role.groups, dst, hf_config=hf_config_from_spec(role.spec).to_dict())
    logger.info("wrote the actor's initial weights to %s for the other pools", dst)


def build_rank(cfg: RL3DConfig, run_dir: str, pool_name: str = "actor") -> RankWorkers:
    """One rank of pool `pool_name` on its pool's initialised torch.distributed world (a Ray
    rank actor)."""
    from rl3d.data import load_tokenizer
    from rl3d.models.bootstrap import init_megatron
    from rl3d.models.spec import get_model_spec

    spec = get_model_spec(cfg.model.name)
    pools = role_pools(cfg)
    pool = hosting(pools, pool_name)  # a pool hosts the role it is named after
    groups = init_megatron(pool.layout, seed=cfg.trainer.seed)
    tokenizer = load_tokenizer(tokenizer_path(cfg), vocab_size=spec.vocab_size)
    return build_rank_workers(cfg, spec, groups, tokenizer, pools=pools, pool=pool, run_dir=Path(run_dir))


def save_rank_files(rank: RankWorkers, tmp: Path, step: int) -> None:
    """This rank's part of a checkpoint: megatron dist checkpoints (collective) and its RNG."""
    from rl3d.checkpoint import capture_rng_state
    from rl3d.models.dist_checkpoint import save_checkpoint

    for name, role in rank.roles.items():
        save_checkpoint(
            tmp / name,
            ddp=role.ddp,
            optimizer=role.optimizer,
            scheduler=role.scheduler,
            groups=rank.groups,
            iteration=step,
        )
    torch.save(capture_rng_state(), tmp / _rng_file(rank))


def load_rank_files(rank: RankWorkers, path: Path) -> None:
    from rl3d.checkpoint import restore_rng_state
    from rl3d.models.dist_checkpoint import load_checkpoint

    for name, role in rank.roles.items():
        load_checkpoint(
            path / name,
            ddp=role.ddp,
            optimizer=role.optimizer,
            scheduler=role.scheduler,
            groups=rank.groups,
        )
    rng = path / _rng_file(rank)
    if not rng.exists() and rank.pool.offset == 0:  # written before pools had names
        rng = path / f"rng_rank{rank.groups.rank}.pt"
    restore_rng_state(torch.load(rng, weights_only=False))


def _rng_file(rank: RankWorkers) -> str:
    return f"rng_{rank.pool.name}_rank{rank.groups.rank}.pt"


# ---------------------------------------------------------------- controller-side


@dataclass
class RankFiles:
    """How the controller has every rank write (or read) its checkpoint files.

    spmd: this process is one rank; `save`/`load` do its own part, `barrier` syncs the world.
    Ray: the driver is the only writer of the directory (`rank` 0, no barrier); `save`/`load`
    ask every rank's actor at once (megatron's save is collective)."""

    save: Callable[[Path, int], None]
    load: Callable[[Path], None]
    rank: int = 0
    world_size: int = 1
    barrier: Callable[[], Any] = lambda: None


def spmd_rank_files(rank: RankWorkers, channel: Any = None) -> RankFiles:
    """This torchrun rank's files; with own pools the barrier spans them through `channel`."""
    return RankFiles(
        save=lambda tmp, step: save_rank_files(rank, tmp, step),
        load=lambda path: load_rank_files(rank, path),
        rank=channel.rank if channel else rank.groups.rank,
        world_size=channel.world_size if channel else dist.get_world_size(),
        barrier=channel.barrier if channel else dist.barrier,
    )


class TrainerCheckpoints:
    """Model + optimizer + scheduler (megatron dist checkpoints), data position, KL controller
    and every rank's RNG, written atomically by `CheckpointManager` (tmp dir, then rename)."""

    def __init__(self, cfg: RL3DConfig, run_dir: Path, ranks: RankFiles):
        from rl3d.checkpoint import CheckpointManager

        self.cfg, self.ranks = cfg, ranks
        self.manager = CheckpointManager(run_dir / "checkpoints", keep_last=cfg.checkpoint.keep_last)

    def due(self, step: int) -> bool:
        every = self.cfg.checkpoint.save_every
        return every > 0 and (step % every == 0 or step == self.cfg.trainer.total_steps)

    def save(self, step: int, trainer: RLTrainer) -> Path:
        def write(tmp: Path) -> None:
            self.ranks.save(tmp, step)
            if self.ranks.rank == 0:
                state = {
                    "step": step,
                    "sampler": trainer.sampler.sampler.state_dict(),
                    "kl_ctl": trainer.kl_ctl.state_dict(),
                    "lagrange": trainer.lagrange.state_dict() if trainer.lagrange else None,
                    "history": trainer.history,
                }
                (tmp / "trainer_state.json").write_text(json.dumps(state))

        r = self.ranks
        return self.manager.save(step, write, rank=r.rank, world_size=r.world_size, barrier=r.barrier)

    def resume(self, sampler, kl_ctl, lagrange=None) -> tuple[int, list]:
        """Restore the newest complete checkpoint; (step, metric history), or (0, []) if none."""
        if self.cfg.checkpoint.resume == "never" or (latest := self.manager.latest()) is None:
            return 0, []
        step, path = latest
        self.ranks.load(path)
        state = json.loads((path / "trainer_state.json").read_text())
        sampler.load_state_dict(state["sampler"])
        kl_ctl.load_state_dict(state["kl_ctl"])
        if lagrange is not None:
            lagrange.load_state_dict(state["lagrange"])
        logger.info("resumed from %s (step %d)", path, step)
        return step, state["history"]


@dataclass
class RunData:
    spec: Any  # rl3d.models.spec.ModelSpec
    tokenizer: Any
    sampler: Any  # rl3d.data.PromptSampler


def build_data(cfg: RL3DConfig) -> RunData:
    """Model spec, tokenizer, prompt dataset and sampler (no process group needed)."""
    from rl3d.data import PromptSampler, load_prompt_dataset, load_tokenizer
    from rl3d.models.spec import get_model_spec
    from rl3d.rewards import answer_check_for

    spec = get_model_spec(cfg.model.name)
    tokenizer = load_tokenizer(tokenizer_path(cfg), vocab_size=spec.vocab_size)
    dataset = load_prompt_dataset(cfg.data, tokenizer, answer_check=answer_check_for(cfg.reward, cfg.data))
    if dataset.num_bad_rows:
        logger.warning("data: skipped %d bad rows (see the log above for file and row)", dataset.num_bad_rows)
    sampler = PromptSampler(
        dataset, prompts_per_step=cfg.data.prompts_per_step, seed=cfg.trainer.seed, shuffle=cfg.data.shuffle
    )
    return RunData(spec, tokenizer, sampler)


def assemble_trainer(
    cfg: RL3DConfig,
    run_dir: Path,
    workers: Workers,
    sampler,
    checkpoints: TrainerCheckpoints,
    *,
    writes: bool,
    agree: Callable[[bool], bool],
) -> RLTrainer:
    """The controller around the worker groups. `writes`: this process logs metrics and
    progress (rank 0 under spmd, the driver under Ray). `agree(flag)`: True on every
    controller once any has its flag set (the backend's, e.g. `single_controller.agree`)."""
    from rl3d import algos
    from rl3d.controller.hooks import load_hooks
    from rl3d.logging import JsonlMetricsWriter, Progress, TensorBoardWriter

    kl = cfg.algorithm.kl
    kl_args = {"kl_coef": kl.coef} | (
        {"target_kl": kl.target, "horizon": kl.horizon} if kl.controller == "adaptive" else {}
    )
    kl_ctl = algos.make_kl_controller(kl.controller, **kl_args)
    lagrange = None
    if cfg.algorithm.family.needs_cost_critic:
        safe = cfg.algorithm.safe_rlhf
        lagrange = algos.LagrangeMultiplier(
            init_value=safe.lagrange_init,
            cost_threshold=safe.cost_threshold,
            lr=safe.lagrange_lr,
            max_value=safe.lagrange_max,
        )
    start_step, history = checkpoints.resume(sampler, kl_ctl, lagrange)
    sinks: list[Any] = []
    if writes:
        if cfg.logging.jsonl:
            sinks.append(JsonlMetricsWriter(run_dir / "metrics.jsonl", rank=0))
        if cfg.logging.tensorboard:
            sinks.append(TensorBoardWriter(run_dir / "tensorboard"))
    progress = Progress(
        cfg.trainer.total_steps, start=start_step, emit=logger.info if writes else (lambda _: None)
    )
    trainer = RLTrainer(
        cfg,
        workers,
        sampler=PromptBatches(sampler),
        kl_ctl=kl_ctl,
        sinks=sinks,
        hooks=load_hooks(cfg.trainer.hooks),
        progress=progress,
        checkpoints=checkpoints,
        start_step=start_step,
        agree=agree,
        lagrange=lagrange,
    )
    trainer.history = history
    return trainer


def build_trainer(loaded: LoadedConfig, run_dir: Path) -> RLTrainer:
    """The spmd assembly: every torchrun rank builds its pool's workers and runs the controller.
    With own pools, each pool first becomes its own world (`rl3d.single_controller.spmd_pools`)."""
    from rl3d.models.bootstrap import init_megatron
    from rl3d.single_controller.spmd_pools import split_world
    from rl3d.workers.roles import RewardWorker

    cfg = loaded.config
    pools = role_pools(cfg)
    pool, channel = pools[0], None
    if len(pools) > 1:
        pool, channel = split_world(pools, backend=dist.get_backend(), timeout_s=cfg.hybrid_engine.timeout_s)
    groups = init_megatron(pool.layout, seed=cfg.trainer.seed)
    data = build_data(cfg)
    rank = build_rank_workers(
        cfg,
        data.spec,
        groups,
        data.tokenizer,
        pools=pools,
        pool=pool,
        run_dir=run_dir,
        sync=channel.barrier if channel else lambda: None,
    )
    if cfg.reward.num_workers:
        logger.warning(
            "reward.num_workers = %d: fanning scoring out needs launch.backend: ray; scoring in process",
            cfg.reward.num_workers,
        )
    roles = [r for p in pools for r in p.roles]
    groups_of = {r: SPMDWorkerGroup(rank.workers.get(r), role=r, channel=channel) for r in roles}
    workers = Workers(
        actor=groups_of["actor"],
        reward=SPMDWorkerGroup(RewardWorker(cfg, data.tokenizer), role="reward"),
        critic=groups_of.get("critic"),
        reference=groups_of.get("reference"),
        cost_critic=groups_of.get("cost_critic"),
    )
    checkpoints = TrainerCheckpoints(cfg, run_dir, spmd_rank_files(rank, channel))
    is_first = (channel.rank if channel else groups.rank) == 0
    return assemble_trainer(
        cfg,
        run_dir,
        workers,
        data.sampler,
        checkpoints,
        writes=is_first,
        agree=lambda flag: agree(flag, channel),
    )
