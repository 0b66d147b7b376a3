"""What a rank's process CPU seconds count when other processes share the cores.

The step simulator's CPU check compares process CPU seconds (`RL3D_STAGE_TIMES_DIR`). Two
questions decide whether that is the right quantity on 2 cores shared by more ranks:

1. Does a rank spend CPU while it waits for a late peer? Rank 1 arrives at an all-reduce (and
   at an object all-gather) `--late-ms` after rank 0, and sets the key rank 0 waits for
   through `AsyncLink` (how a trainer waits for a separate rollout pool's rows: a store check
   every `POLL_S`, the store served by rank 0's own process as in a run); rank 0's CPU seconds
   in each wait are printed beside its wall seconds.
2. How much do other processes inflate the CPU seconds of the same work? The quickstart
   model's tensor-parallel forward (tp = 2, log-probs of 32 sequences of 24 tokens, 4
   micro-batches) in two ranks, alone, beside a process that polls every 2 ms (what an idle
   rollout-pool rank does), and beside 1 and 3 busy processes; `--rounds` rounds, the
   conditions interleaved, each the least and the median of 6 forwards on each rank.
3. Does the first forward after a rollout cost more (the rollout leaving caches cold)? In a
   one-rank run of the PPO quickstart (`RLTrainer` as `rl3d train` builds it), the actor's
   `compute_log_prob` right after each step's `generate` and once more, over 9 steps.

    python benchmarks/simulator_contention.py  # about a minute on a quiet machine
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rl3d.utils.net import free_port

ROOT = Path(__file__).resolve().parents[1]
CONDITIONS = {"alone": (0, ""), "poller": (1, "poll"), "1 busy": (1, "busy"), "3 busy": (3, "busy")}


def _other(mode: str, stop) -> None:
    torch.set_num_threads(1)
    a = torch.randn(256, 256)
    while not stop.is_set():
        if mode == "busy":
            a = torch.tanh(a @ a * 0.01)
        else:
            time.sleep(0.002)


def _late_peer(rank: int, late_s: float, store_port: int) -> None:
    import datetime

    from rl3d.single_controller.async_link import POLL_S, AsyncLink

    store = dist.TCPStore(
        "127.0.0.1", store_port, 2, is_master=rank == 0, timeout=datetime.timedelta(seconds=60)
    )
    link = AsyncLink(store, timeout_s=60, who=f"rank {rank}")
    for name, call in (
        ("all-reduce", lambda: dist.all_reduce(torch.zeros(1024))),
        ("object all-gather", lambda: dist.all_gather_object([None, None], {"rows": list(range(256))})),
        (f"link wait (a store check every {POLL_S * 1e3:.0f} ms)",
         lambda: link._wait("rows", "the rows") if rank == 0 else link.store.set("rows", b"1")),
    ):  # fmt: skip
        dist.barrier()
        if rank == 1:
            time.sleep(late_s)
        cpu, wall = time.process_time(), time.perf_counter()
        call()
        if rank == 0:
            print(f"{name}, peer {late_s * 1e3:.0f} ms late: wall {time.perf_counter() - wall:.4f} s, "
                  f"CPU {time.process_time() - cpu:.4f} s", flush=True)  # fmt: skip


def _worker(rank: int, port: int, args) -> None:
    from simulator_microbench import batch_of

    from rl3d.config import load_config
    from rl3d.engine import MegatronEngine, Training
    from rl3d.models.bootstrap import init_megatron
    from rl3d.models.logprobs import vocab_parallel_logprobs_entropy
    from rl3d.models.spec import spec_of
    from rl3d.parallel.layout import ParallelLayout

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    _late_peer(rank, args.late_ms / 1e3, args.store_port)
    cfg = load_config(ROOT / "recipes/quickstart_cpu_ppo.yaml").config
    groups = init_megatron(ParallelLayout(1, 2, 1), seed=1)
    torch.manual_seed(0)
    spec = spec_of(cfg.model)
    batch = batch_of(spec, 32, cfg.data.max_prompt_length, cfg.rollout.max_new_tokens)
    training = Training(cfg.actor.optim, total_steps=1000)
    role = MegatronEngine(spec, groups, role="actor", params_dtype=torch.float32, seed=1, training=training)

    def extract(output, micro):
        logits = role.response_slice(output, micro)
        lp, _ = vocab_parallel_logprobs_entropy(
            logits, micro["responses"], groups.tp_group, vocab_size=spec.vocab_size
        )
        return torch.zeros(()), {"old_logp": lp}

    ctx = mp.get_context("spawn")
    for round_index in range(args.rounds):
        for name, (count, mode) in CONDITIONS.items():
            stop, others = ctx.Event(), []
            dist.barrier()
            if rank == 0:
                others = [ctx.Process(target=_other, args=(mode, stop)) for _ in range(count)]
                for p in others:
                    p.start()
                time.sleep(0.5)
            dist.barrier()
            times = []
            for _ in range(6):
                cpu = time.process_time()
                role.run_forward(batch, 8, extract)
                times.append(time.process_time() - cpu)
            stop.set()
            for p in others:
                p.join()
            both: list = [None, None]
            dist.all_gather_object(both, times)
            if rank == 0:
                cells = ", ".join(f"{min(t) * 1e3:.1f} / {statistics.median(t) * 1e3:.1f}" for t in both)
                print(f"round {round_index} {name}: tp=2 forward CPU ms, least / median, per rank: {cells}",
                      flush=True)  # fmt: skip
    dist.destroy_process_group()


def _after_rollout(steps: int) -> None:
    import os
    import tempfile

    from rl3d.config import load_config
    from rl3d.controller.build import build_run
    from rl3d.launch.spmd_backend import SPMDRun

    torch.set_num_threads(1)
    os.environ |= {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "RANK": "0",
        "WORLD_SIZE": "1",
    }
    dist.init_process_group("gloo", rank=0, world_size=1)
    run_dir = tempfile.mkdtemp()
    overrides = [
        "launch.nproc_per_node=1",
        "rollout.t_g=1",
        f"trainer.run_dir={run_dir}",
        "checkpoint.save_every=0",
    ]
    overrides += [f"{role}.parallel.{axis}=1" for role in ("actor", "critic") for axis in ("tp", "dp")]
    trainer = build_run(
        load_config(ROOT / "recipes/quickstart_cpu_ppo.yaml", overrides).config, Path(run_dir), SPMDRun()
    )
    trainer.placement.start(0, trainer.sampler.sampler.state_dict)
    first, second = [], []
    for step in range(1, steps + 1):
        trainer.publish_weights(step - 1)
        batch = trainer.generate(step, {})
        for times in (first, second):
            cpu = time.process_time()
            trainer.roles.actor.call("compute_log_prob", batch)
            times.append(time.process_time() - cpu)
    trainer.placement.stop(None)
    print(f"forward right after the rollout, CPU ms, least / median of {steps}: "
          f"{min(first) * 1e3:.1f} / {statistics.median(first) * 1e3:.1f}; the next one: "
          f"{min(second) * 1e3:.1f} / {statistics.median(second) * 1e3:.1f}", flush=True)  # fmt: skip
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--late-ms", type=float, default=300.0)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    args.store_port = free_port()
    mp.spawn(_worker, args=(free_port(), args), nprocs=2)
    proc = mp.get_context("spawn").Process(target=_after_rollout, args=(9,))
    proc.start()
    proc.join()
    return proc.exitcode


if __name__ == "__main__":
    raise SystemExit(main())
