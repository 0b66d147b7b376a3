"""Assemble a run from its resolved config, the same way on both worker-group backends.

A backend (`SPMDBackend` in `rl3d.launch.spmd_backend`, `RayBackend` in `rl3d.launch.ray_launch`)
says how a role's worker group is reached, how ranks write checkpoint files, how controllers
agree on a stop, and whether this process writes logs. Everything else (the role groups from
the role table, data, the KL controller, checkpoints, logging, the trainer) is built here once.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from rl3d.config import RL3DConfig
from rl3d.config.roles import ACTOR, RoleSpec, role_table
from rl3d.controller.prompts import prompt_batch
from rl3d.controller.rank import run_tokenizer
from rl3d.controller.trainer import RLTrainer
from rl3d.single_controller.batch import DataBatch

logger = logging.getLogger(__name__)


class PromptBatches:
    """The sampler's prompts as DataBatches (identical on every rank: same seed)."""

    def __init__(self, sampler):
        self.sampler = sampler

    def next_batch(self) -> DataBatch:
        return prompt_batch(self.sampler.next_batch())


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


class Backend(Protocol):
    """What the assembly needs from a worker-group backend."""

    writes: bool  # this process logs metrics and progress (spmd rank 0, the Ray driver)

    def group(self, role: str) -> Any: ...  # the role's worker group: .call("method", ...)

    def reward_group(self) -> Any: ...

    def rank_files(self) -> RankFiles: ...

    def agree(self, flag: bool) -> bool: ...  # True on every controller once any flag is set


@dataclass
class RoleGroups:
    """The worker group of every role in the table (table order), and the reward's."""

    table: list[RoleSpec]
    groups: dict[str, Any]
    reward: Any

    @property
    def actor(self) -> Any:
        return self.groups[ACTOR]

    def stages(self, kind: str) -> list[tuple[str, str, Any]]:
        """(timer stage, method, group) of every role with a `kind` ("compute"/"update") stage."""
        out = []
        for role in self.table:
            method = getattr(role, kind)
            if method is not None:
                out.append((getattr(role, f"{kind}_stage"), method, self.groups[role.name]))
        return out


class TrainerCheckpoints:
    """Model + optimizer + scheduler (megatron dist checkpoints), data position, KL controller
    and every rank's RNG, written atomically by `CheckpointManager` (tmp dir, then rename); with
    `checkpoint.save_hf`, also the actor as an HF directory (`step_N/hf`), exported by rank 0."""

    def __init__(self, cfg: RL3DConfig, run_dir: Path, ranks: RankFiles):
        from rl3d.checkpoint import CheckpointManager, checkpoint_identity

        self.cfg, self.ranks, self.run_dir = cfg, ranks, run_dir
        self.manager = CheckpointManager(
            run_dir / "checkpoints", keep_last=cfg.checkpoint.keep_last, identity=checkpoint_identity(cfg)
        )

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
                    "algorithm": trainer.algorithm.state_dict(),
                    "history": trainer.history,
                }
                (tmp / "trainer_state.json").write_text(json.dumps(state))
                if self.cfg.checkpoint.save_hf:  # reads the ranks' finished files, in any layout
                    from rl3d.models.export import HF_SUBDIR, export_hf
                    from rl3d.models.spec import spec_of

                    model = self.cfg.model
                    export_hf(tmp / ACTOR, spec_of(model), tmp / HF_SUBDIR, source=model.hf_path)

        r = self.ranks
        return self.manager.save(step, write, rank=r.rank, world_size=r.world_size, barrier=r.barrier)

    def resume(self, sampler, kl_ctl, algorithm) -> tuple[int, list]:
        """Restore the newest complete checkpoint; (step, metric history), or (0, []) if none."""
        if self.cfg.checkpoint.resume == "never":
            return 0, []
        latest = self.manager.resume_point()  # skips a damaged newest one (the launcher moved it aside)
        if self.ranks.rank == 0:  # a killed run's rows after the resumed step are not this run's
            from rl3d.logging import drop_rows_after

            drop_rows_after(self.run_dir, latest[0] if latest else 0)
        if latest is None:
            return 0, []
        step, path = latest
        self.ranks.load(path)
        state = json.loads((path / "trainer_state.json").read_text())
        sampler.load_state_dict(state["sampler"])
        kl_ctl.load_state_dict(state["kl_ctl"])
        # checkpoints before algorithm objects kept Safe-RLHF's multiplier at the top level
        algorithm.load_state_dict(state.get("algorithm") or {"lagrange": state.get("lagrange")})
        logger.info("resumed from %s (step %d)", path, step)
        return step, state["history"]


@dataclass
class RunData:
    spec: Any  # rl3d.models.spec.ModelSpec
    tokenizer: Any
    sampler: Any  # rl3d.data.PromptSampler
    val_prompts: list = field(default_factory=list)  # PromptItems of trainer.val_every


def build_data(cfg: RL3DConfig) -> RunData:
    """Model spec, tokenizer, prompt dataset and sampler (no process group needed)."""
    from rl3d.data import PromptSampler, load_prompt_dataset
    from rl3d.models.spec import spec_of
    from rl3d.rewards import answer_check_for

    spec = spec_of(cfg.model)
    tokenizer = run_tokenizer(cfg, spec)
    dataset = load_prompt_dataset(cfg.data, tokenizer, answer_check=answer_check_for(cfg.reward, cfg.data))
    if dataset.num_bad_rows:
        logger.warning("data: skipped %d bad rows (see the log above for file and row)", dataset.num_bad_rows)
    sampler = PromptSampler(
        dataset, prompts_per_step=cfg.data.prompts_per_step, seed=cfg.trainer.seed, shuffle=cfg.data.shuffle
    )
    if not cfg.trainer.validates:
        return RunData(spec, tokenizer, sampler)
    from rl3d.controller.validation import validation_prompts

    return RunData(spec, tokenizer, sampler, validation_prompts(cfg, tokenizer, dataset))


def role_groups(cfg: RL3DConfig, backend: Backend) -> RoleGroups:
    table = role_table(cfg)
    return RoleGroups(table, {r.name: backend.group(r.name) for r in table}, backend.reward_group())


def assemble_trainer(
    cfg: RL3DConfig,
    run_dir: Path,
    backend: Backend,
    data: RunData,
    *,
    placement: Any = None,
) -> RLTrainer:
    """The controller around the role groups: KL controller, resume, metric sinks, hooks, and
    where the rollout runs (`placement`, `rl3d.controller.placement.placement_of`; default:
    colocated with the actor)."""
    from rl3d import algos
    from rl3d.config.tracking import trackers_of
    from rl3d.config.typed import to_dict
    from rl3d.controller.hooks import load_hooks
    from rl3d.controller.placement import Colocated
    from rl3d.logging import JsonlMetricsWriter, Progress
    from rl3d.logging.trackers import make_trackers

    kl = cfg.algorithm.kl
    kl_args = {"kl_coef": kl.coef} | (
        {"target_kl": kl.target, "horizon": kl.horizon} if kl.controller == "adaptive" else {}
    )
    kl_ctl = algos.make_kl_controller(kl.controller, **kl_args)
    algorithm = algos.Algorithm(cfg.algorithm)
    checkpoints = TrainerCheckpoints(cfg, run_dir, backend.rank_files())
    start_step, history = checkpoints.resume(data.sampler, kl_ctl, algorithm)
    writes = backend.writes
    sinks: list[Any] = []
    if writes:
        if cfg.logging.jsonl:
            sinks.append(JsonlMetricsWriter(run_dir / "metrics.jsonl", rank=0))
        sinks += make_trackers(  # TensorBoard, W&B, MLflow: logging.trackers
            trackers_of(cfg.logging), run_dir, experiment=cfg.trainer.experiment, config=to_dict(cfg)
        )
    progress = Progress(
        cfg.trainer.total_steps, start=start_step, emit=logger.info if writes else (lambda _: None)
    )
    roles = role_groups(cfg, backend)
    placement = placement or Colocated()
    placement.bind(roles)
    trainer = RLTrainer(
        cfg,
        roles,
        sampler=PromptBatches(data.sampler),
        kl_ctl=kl_ctl,
        sinks=sinks,
        hooks=load_hooks(cfg.trainer.hooks),
        progress=progress,
        checkpoints=checkpoints,
        start_step=start_step,
        agree=backend.agree,
        algorithm=algorithm,
        placement=placement,
    )
    trainer.history = history
    if writes and cfg.logging.samples:
        from rl3d.logging.samples import SamplesLog
        from rl3d.rollout.stops import end_token_ids

        texts = [s for s in sinks if hasattr(s, "log_text")]  # TensorBoard's Text tab
        trainer.samples = SamplesLog(
            run_dir,
            data.tokenizer,
            num=cfg.logging.samples,
            end_ids=end_token_ids(cfg.data, cfg.model.hf_path),
            text_sinks=texts,
        )
    if cfg.trainer.validates:
        from rl3d.controller.validation import Validator

        trainer.validation = Validator(
            cfg,
            trainer.rollout,
            trainer.score,
            data.val_prompts,
            sinks=sinks,
            run_dir=run_dir,
            writes=writes,
            samples=trainer.samples,
        )
    return trainer
