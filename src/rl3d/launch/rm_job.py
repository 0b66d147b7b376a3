"""`rl3d train` of a reward-model recipe (`job: reward_model`): check it, then start its ranks
with torchrun on `rl3d.controller.rm_train` (the job itself)."""

from __future__ import annotations

from pathlib import Path


def describe(loaded) -> str:
    cfg = loaded.config
    par, rm, data = cfg.parallel, cfg.rm, cfg.data
    source = (
        ", ".join(data.train_files)
        or f"synthetic rule {data.synthetic.rule} ({data.synthetic.num_pairs} pairs)"
    )
    return "\n".join(
        [
            f"recipe       {loaded.recipe}  ({cfg.description or 'no description'})",
            f"job          {rm.objective} model, Bradley-Terry; p-t-d = {par.pp}-{par.tp}-{par.dp}",
            f"model        {cfg.model.label} ({cfg.model.dtype}) with a scalar head",
            f"data         {source}",
            f"batch        {rm.batch_size} pairs per step, {cfg.trainer.total_steps} steps",
        ]
    )


def launch_rm(loaded, overrides: list[str], *, emit, dry_run: bool = False, overwrite: bool = False) -> int:
    """`rl3d train` of a reward-model recipe: check its files, then start its ranks with torchrun.
    A run directory holding an earlier job is refused unless `overwrite` (which removes it)."""
    import shlex
    import shutil
    import subprocess

    from rl3d.config import ConfigError, run_dir_of
    from rl3d.launch.torchrun_job import first_rank_failure, launch_env, torchrun_command

    cfg = loaded.config
    for i, f in enumerate([*cfg.data.train_files, *cfg.data.val_files]):
        if not Path(f).is_file():
            key = f"data.train_files[{i}]" if i < len(cfg.data.train_files) else "data.val_files"
            raise ConfigError(f"{f}: no such file", key=key, source=loaded.source_of(key))
    run_dir = run_dir_of(cfg)
    earlier = run_dir / "checkpoints"
    if earlier.exists() and not dry_run:
        if not overwrite:
            raise ConfigError(
                f"{run_dir} holds an earlier reward-model run; pass --overwrite or set trainer.run_dir",
                key="trainer.run_dir",
            )
        shutil.rmtree(run_dir)
    emit(describe(loaded))
    command = torchrun_command(
        loaded.recipe, overrides, cfg.launch.nproc_per_node, module="rl3d.controller.rm_train"
    )
    emit("command      " + shlex.join(command))
    if dry_run:
        return 0
    from rl3d.utils.lifetime import die_with_parent

    code = subprocess.call(command, env=launch_env(), preexec_fn=die_with_parent)  # torchrun ends with us
    if code:
        emit("rl3d: run failed: " + first_rank_failure(run_dir / "logs", code))
    return code
