"""`rl3d train`: validate the recipe, then start its ranks with torchrun on this machine, or (with
`launch.backend: ray`) run the Ray driver in this process."""

from __future__ import annotations

import logging
import shlex
from collections.abc import Callable

from rl3d.config import load_config, run_dir_of
from rl3d.launch.preflight import check_run_dir, preflight
from rl3d.launch.preflight_memory import kv_pool_override
from rl3d.launch.torchrun_job import RANK_EXITS, first_rank_failure, launch_env, torchrun_command

logger = logging.getLogger(__name__)

# Set for the ranks `rl3d train` starts: the launcher ran the preflight, the ranks need not.
PREFLIGHT_DONE_ENV = "RL3D_PREFLIGHT_DONE"


def describe(loaded) -> str:
    cfg = loaded.config
    par = cfg.actor.parallel
    cp = f" cp={par.cp}" if par.cp > 1 else ""
    lines = [
        f"recipe       {loaded.recipe}  ({cfg.description or 'no description'})",
        f"model        {cfg.model.label} ({cfg.model.dtype})",
        f"actor        train p-t-d = {par.pp}-{par.tp}-{par.dp}{cp}; generate t_g={cfg.rollout.t_g}, "
        f"p_g={cfg.rollout.p_g} with the {cfg.rollout.engine} engine",
        f"algorithm    {cfg.algorithm.adv_estimator}; critic {'on' if cfg.critic_enabled else 'off'}, "
        f"reference {'on' if cfg.reference_enabled else 'off'}",
        f"batch        {cfg.data.prompts_per_step} prompts x n={cfg.rollout.n} per step, "
        f"{cfg.trainer.total_steps} steps",
        f"stops        {_stops(cfg)}",
        f"launch       {cfg.launch.backend}, {cfg.launch.nnodes} node(s) x {cfg.launch.nproc_per_node} ranks",
    ]
    return "\n".join(lines)


def _stops(cfg) -> str:
    """Where generation stops (`rl3d.rollout.stops`), said once before the run starts."""
    from rl3d.rollout.stops import end_token_ids, stop_token_ids

    ids = list(stop_token_ids(cfg.rollout, cfg.data, cfg.model.hf_path))
    if not cfg.data.train_files:
        why = "rollout.stop_token_ids; a synthetic task has no end id"
    elif cfg.rollout.ignore_eos:
        why = "rollout.stop_token_ids; rollout.ignore_eos: true"
    else:
        ends = sorted(end_token_ids(cfg.data, cfg.model.hf_path))
        why = f"the model's end ids {ends} and rollout.stop_token_ids"
    return f"at token ids {ids or 'none'} ({why}), else after {cfg.rollout.max_new_tokens} tokens"


def launch_train(
    recipe: str,
    overrides: list[str],
    *,
    emit: Callable[[str], None],
    dry_run: bool = False,
    overwrite: bool = False,
    device_gib: float | None = None,
) -> int:
    """Validate and preflight first (bad input fails before any process starts), then launch;
    `emit` shows the user what will run. `overwrite` deletes an earlier run's outputs in the
    run dir first (a dry run only checks). `device_gib`: the GPU size the memory plan must fit
    (default: the host's GPU on a CUDA run)."""
    loaded = load_config(recipe, overrides)
    if getattr(loaded.config, "job", None) == "reward_model":  # rl3d.controller.rm_train
        from rl3d.launch.rm_job import launch_rm

        return launch_rm(loaded, overrides, emit=emit, dry_run=dry_run, overwrite=overwrite)
    preflight(loaded, device_gib=device_gib)
    kv_pool = kv_pool_override(loaded, device_gib)
    if kv_pool is not None:  # the ranks (and resolved_config.yaml) get the plan's number
        overrides = [*overrides, kv_pool]
        loaded = load_config(recipe, overrides)
        emit(f"memory plan  {kv_pool} (SGLang's KV pool per rank)")
    removed = check_run_dir(loaded, overwrite=overwrite, launcher=not dry_run)
    emit(describe(loaded))
    if removed:
        emit(f"overwrite    removed {', '.join(removed)} of the earlier run")
    if loaded.config.launch.backend == "ray":
        from rl3d.launch.ray_launch import describe_driver, run_driver

        emit("command      " + describe_driver(loaded.config))
        return 0 if dry_run else run_driver(loaded)
    command = torchrun_command(recipe, overrides, loaded.config.launch.nproc_per_node)
    emit("command      " + shlex.join(command))
    if dry_run:
        return 0
    import subprocess

    log_dir = run_dir_of(loaded.config) / "logs"
    for stale in [*log_dir.glob("failed_rank*.txt"), log_dir / RANK_EXITS]:  # an earlier run's
        stale.unlink(missing_ok=True)
    env = launch_env(**{PREFLIGHT_DONE_ENV: "1", "RL3D_RANK_EXITS": str(log_dir / RANK_EXITS)})
    from rl3d.utils.lifetime import die_with_parent

    code = subprocess.call(command, env=env, preexec_fn=die_with_parent)  # torchrun ends with us
    if code:
        from rl3d.config.pools import role_pools

        emit("rl3d: run failed: " + first_rank_failure(log_dir, code, pools=role_pools(loaded.config)))
    return code
