"""The controller's generate stage timed as `rl3d train` runs it, for the step simulator's CPU
device class (`benchmarks/simulator_microbench.py` writes these rows with its own).

Colocated (`stage_rows`): one rank, the actor's worker generating. With a separate rollout pool
(`separate_rows`): the trainer's ranks in the recipe's layout and a pool rank, the trainer's
`generate` (its wait for the pool's rows, their hand-over, the reward, the controller's part)
and the pool's generation, each in its own process's CPU seconds, summed as the validation sums
them; each row also counts the pool's generation seconds, through which the trainer waits (its
polls cost CPU per second of waiting). Right after each such wait the actor's forward (its old
log-probs) is timed twice: woken, and repeated at once.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from rl3d.config import load_config
from rl3d.models.spec import spec_of
from rl3d.planning.calibration import low_percentile
from rl3d.planning.simulator import forward_flops
from rl3d.utils.net import free_port


def cpu_times(fn, repeats: int, setup=lambda: None) -> list[float]:
    """The process CPU seconds of `repeats` calls (after one warm-up call), each after `setup()`."""
    setup()
    fn()
    times = []
    for _ in range(repeats):
        setup()
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return times


def _row(kind: str, layers: int, flops: float, times: list[float], **counts: float) -> dict:
    """A calibration row: `times` are its repeats' CPU seconds, `seconds` their low percentile."""
    return {"kind": kind, "layers": layers, "flops": flops, "seconds": low_percentile(times),
            "times": times, "counts": counts}  # fmt: skip


def _stage_counts(cfg, prompts: int) -> tuple[int, float, dict]:
    """Layers, FLOPs and the costs a step's rollout at `prompts` prompts pays (the engine's, the
    reward's, the controller's)."""
    spec, k, P = spec_of(cfg.model), cfg.rollout.max_new_tokens, cfg.data.max_prompt_length
    n, L = prompts * cfg.rollout.n, spec.num_layers
    flops = forward_flops(spec, n * P, P / 2) + k * forward_flops(spec, n, P + k / 2)
    counts = {"gen_call_s": 1, "step_overhead_s": k, "decode_layer_s": (k + 1) * L, "score_sample_s": n,
              "control_step_s": 1, "control_sample_s": n}  # fmt: skip
    return L, flops, counts


def _one_rank_overrides(prompts: int, run_dir: str) -> list[str]:
    overrides = [f"data.prompts_per_step={prompts}", f"trainer.run_dir={run_dir}", "checkpoint.save_every=0"]
    return overrides + [f"{role}.parallel.{axis}=1" for role in ("actor", "critic") for axis in ("tp", "dp")]


def _join(rank: int, world: int, port: int) -> None:
    torch.set_num_threads(1)
    os.environ |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                   "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world)}  # fmt: skip
    dist.init_process_group("gloo", rank=rank, world_size=world)


def _stage_row(recipe: str, prompts: int, repeats: int, run_dir: str) -> dict:
    """The controller's whole `generate` stage as `rl3d train` runs it, on one rank (world 1,
    colocated, t_g = 1) at `prompts` prompts a step: prompts sampled, the engine's cache resumed,
    one replica's rollout, the rule reward, the rows joined; the weights published (untimed)
    before each step's."""
    from rl3d.controller.build import build_run
    from rl3d.launch.spmd_backend import SPMDRun
    from rl3d.models.bootstrap import destroy_megatron

    overrides = [*_one_rank_overrides(prompts, run_dir), "launch.nproc_per_node=1", "rollout.t_g=1"]
    cfg = load_config(recipe, overrides).config
    trainer = build_run(cfg, Path(run_dir), SPMDRun())
    trainer.placement.start(0, trainer.sampler.sampler.state_dict)
    steps, step = iter(range(1, 10 * repeats)), 0

    def publish() -> None:
        nonlocal step
        step = next(steps)
        trainer.publish_weights(step - 1)

    times = cpu_times(lambda: trainer.generate(step, {}), repeats, setup=publish)
    trainer.placement.stop(None)
    destroy_megatron()
    layers, flops, counts = _stage_counts(cfg, prompts)
    return _row("generate_stage", layers, flops, times, **counts)


def _stage_worker(recipe: str, repeats: int, out) -> None:
    _join(0, 1, free_port())
    prompts, run_dir = load_config(recipe).config.data.prompts_per_step, tempfile.mkdtemp()
    out.put([_stage_row(recipe, m, repeats, run_dir) for m in (prompts, prompts // 2)])
    dist.destroy_process_group()


def stage_rows(recipe: Path, repeats: int) -> list[dict]:
    """`_stage_row` at the recipe's prompts a step and half, in a process of its own (it builds
    a whole run)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_stage_worker, args=(str(recipe), repeats, queue))
    proc.start()
    rows = queue.get(timeout=1200)
    proc.join()
    return rows


def _trainer_ranks(recipe) -> int:
    return load_config(recipe).config.actor.parallel.world_size


def _separate_worker(
    rank: int, port: int, recipe: str, prompts: int, repeats: int, run_dir: str, out
) -> None:
    """The trainer's ranks in the recipe's layout (rank 0 reports), then a rollout pool of one
    rank; the trainer publishes each step's weights (untimed), then its `generate` waits for
    the pool's rows of that step (timed)."""
    from rl3d.controller.build import build_run
    from rl3d.controller.rows import fit_rows
    from rl3d.launch.spmd_backend import SPMDRun
    from rl3d.models.bootstrap import destroy_megatron

    world = _trainer_ranks(recipe) + 1
    _join(rank, world, port)
    overrides = [
        f"data.prompts_per_step={prompts}", f"trainer.run_dir={run_dir}", "checkpoint.save_every=0",
        f"launch.nproc_per_node={world}", f"trainer.total_steps={repeats + 3}",
        "rollout.placement=separate", "rollout.pool.tp=1", "rollout.pool.dp=1",
    ]  # fmt: skip
    cfg = load_config(recipe, overrides).config
    runner = build_run(cfg, Path(run_dir), SPMDRun())
    if rank == world - 1:
        runner.fit()  # generates each step once its weights came, until the trainer stops
        destroy_megatron()
        return
    runner.placement.start(0, runner.sampler.sampler.state_dict)
    times, waits, first, again = [], [], [], []
    for step in range(1, repeats + 2):  # the first a warm-up
        runner.publish_weights(step - 1)
        metrics: dict[str, float] = {}
        start = time.process_time()
        batch = runner.generate(step, metrics)
        done = time.process_time()
        batch, _ = fit_rows(batch, cfg)  # as the loop's old_logp stage takes it
        runner.roles.actor.call("compute_log_prob", batch)
        woken = time.process_time()
        runner.roles.actor.call("compute_log_prob", batch)
        if step > 1:
            times.append(done - start + metrics["async/rollout_generate_cpu_s"])
            waits.append(metrics["async/rollout_generate_cpu_s"])  # what the simulator's wait is
            first.append(woken - done)
            again.append(time.process_time() - woken)
    runner.placement.stop(None)
    destroy_megatron()
    if rank:
        return
    layers, flops, counts = _stage_counts(cfg, prompts)
    counts |= {"handover_s": 1, "handover_wait_share": statistics.median(waits)}
    out.put([
        _row("generate_separate", layers, flops, times, **counts),
        _row("forward_after_wait", layers, 0.0, first) | {"samples": len(batch)},
        _row("forward_again", layers, 0.0, again) | {"samples": len(batch)},
    ])  # fmt: skip


def separate_rows(recipe: Path, repeats: int) -> list[dict]:
    """The generate stage with a separate rollout pool at the recipe's prompts a step and half,
    each with the trainer's ranks in the recipe's layout and a pool rank in processes of their
    own, and the actor's forward right after each (the old log-probs) and again at once."""
    import torch.multiprocessing as mp

    ctx, rows = mp.get_context("spawn"), []
    full = load_config(recipe).config.data.prompts_per_step
    for prompts in (full, full // 2):
        queue, port, run_dir = ctx.Queue(), free_port(), tempfile.mkdtemp()
        args = (port, str(recipe), prompts, repeats, run_dir, queue)
        procs = [
            ctx.Process(target=_separate_worker, args=(r, *args)) for r in range(_trainer_ranks(recipe) + 1)
        ]
        for p in procs:
            p.start()
        rows += queue.get(timeout=1200)
        for p in procs:
            p.join()
    return rows
