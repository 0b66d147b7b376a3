"""The actor's old log-probs at tensor parallelism 2, piece by piece, in a real 2-rank trainer.

Builds `recipes/quickstart_cpu_ppo.yaml` (actor and critic at tp=2) as `rl3d train` does on two
ranks, makes one step's rollout, and times (process CPU seconds, each rank, low percentile and
least of `--repeats` after a warm-up) what the `old_logp` stage runs, from the outside in:

- `call`: the trainer's call, `roles.actor.call("compute_log_prob", batch)` (dispatch, the
  worker, the gather of its output);
- `worker`: the worker's method on the rank's share of the batch;
- `run_forward`: the megatron role's forward over the micro-batches with the log-probs;
- `microbench`: a fresh role as `benchmarks/simulator_microbench.py` builds it, on its synthetic
  batch (what the calibration's tensor-parallel rows time);
- `call after N ms asleep`: the trainer's call after both ranks slept N ms (as a trainer rank
  waits for a separate rollout pool's rows), against the same call back to back.

    python benchmarks/simulator_tp_forward.py [--repeats 8]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from simulator_microbench import batch_of
from simulator_stages import _join, cpu_times

from rl3d.config import load_config
from rl3d.planning.calibration import low_percentile
from rl3d.utils.net import free_port

RECIPE = Path(__file__).resolve().parents[1] / "recipes/quickstart_cpu_ppo.yaml"
NAPS_MS = (20, 100)


def _worker(rank: int, port: int, repeats: int, out) -> None:
    from rl3d.controller.build import build_run
    from rl3d.controller.rows import fit_rows
    from rl3d.engine import MegatronEngine, Training
    from rl3d.launch.spmd_backend import SPMDRun
    from rl3d.models.logprobs import vocab_parallel_logprobs_entropy
    from rl3d.single_controller.dispatch import MODES, dispatch_mode

    _join(rank, 2, port)
    run_dir = tempfile.mkdtemp()
    cfg = load_config(RECIPE, [f"trainer.run_dir={run_dir}", "checkpoint.save_every=0"]).config
    trainer = build_run(cfg, Path(run_dir), SPMDRun())
    trainer.placement.start(0, trainer.sampler.sampler.state_dict)
    trainer.publish_weights(0)
    batch, _ = fit_rows(trainer.generate(1, {}), cfg)
    group = trainer.roles.actor
    worker, role, micro = group.worker, group.worker.role, cfg.actor.micro_batch_size
    mode = MODES[dispatch_mode(worker.compute_log_prob)]
    share = mode.split(batch, mode.slot(worker.dispatch_info()))
    spec, groups, tp_group = role.spec, role.groups, role.groups.tp_group
    training = Training(cfg.actor.optim, total_steps=1000)
    fresh = MegatronEngine(spec, groups, role="actor", params_dtype=torch.float32, seed=1, training=training)
    torch.manual_seed(0)
    synthetic = batch_of(spec, len(batch), cfg.data.max_prompt_length, cfg.rollout.max_new_tokens)

    def extract_of(model):
        def extract(output, m):
            logits = model.response_slice(output, m)
            lp, ent = vocab_parallel_logprobs_entropy(
                logits, m["responses"], tp_group, vocab_size=spec.vocab_size
            )
            return torch.zeros(()), {"old_logp": lp.detach(), "entropy": ent.detach()}

        return extract

    def nap(ms: int):
        def setup() -> None:
            dist.barrier()
            time.sleep(ms / 1e3)

        return setup

    call = lambda: group.call("compute_log_prob", batch)  # noqa: E731
    pieces = {
        "call": (call, dist.barrier),
        "worker": (lambda: worker.compute_log_prob(share), dist.barrier),
        "run_forward": (lambda: role.run_forward(share, micro, extract_of(role)), dist.barrier),
        "microbench": (lambda: fresh.run_forward(synthetic, micro, extract_of(fresh)), dist.barrier),
        **{f"call after {ms} ms asleep": (call, nap(ms)) for ms in NAPS_MS},
    }
    times: dict[str, list[float]] = {name: [] for name in pieces}
    for _ in range(2):  # two interleaved rounds
        for name, (fn, setup) in pieces.items():
            times[name] += cpu_times(fn, repeats // 2, setup=setup)
    trainer.placement.stop(None)
    out.put((rank, times))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    import torch.multiprocessing as mp

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=8)
    args = parser.parse_args(argv)
    ctx = mp.get_context("spawn")
    queue, port, load = ctx.Queue(), free_port(), os.getloadavg()[0]
    procs = [ctx.Process(target=_worker, args=(r, port, args.repeats, queue)) for r in (0, 1)]
    for p in procs:
        p.start()
    got = dict(queue.get(timeout=1200) for _ in procs)
    for p in procs:
        p.join()
    print(f"load (1 min) {load:.1f} before, {os.getloadavg()[0]:.1f} after; CPU ms, low percentile (least)")
    print("| piece | rank 0 | rank 1 |\n|---|---|---|")
    for name in got[0]:
        cells = [f"{low_percentile(got[r][name]) * 1e3:.1f} ({min(got[r][name]) * 1e3:.1f})" for r in (0, 1)]
        print(f"| {name} | {' | '.join(cells)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
