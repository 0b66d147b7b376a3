"""Profile rl3d's actor update on SmolLM2-135M-Instruct in one process, the step of
benchmarks/real_model_step.py (4 prompts x 8 samples x 12 tokens, one optimizer step):

    python benchmarks/real_model_step/profile_update.py [torch|cprofile|ab]

prints the torch profiler's op table (or cProfile's) of one `update_actor` after a warm-up one;
`ab` times `update_actor` and the forward-only `compute_log_prob` alternately without and with
the output layer cut to the response positions (`MegatronEngine.batches.response_outputs`),
`--pairs` pairs, in wall seconds and in this process's CPU-seconds (all its threads: on a shared
machine the work, where the wall time also measures the scheduler), and checks the cut's
log-probs against the whole sequence's.
Reads the prompts that benchmarks/real_model_step.py writes (`--prompts` to change).
"""

from __future__ import annotations

import argparse
import datetime
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent


def build_actor(prompts_path: str):
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    from rl3d.config import load_config
    from rl3d.models.bootstrap import init_megatron
    from rl3d.models.hub import ensure_model
    from rl3d.models.spec import spec_of
    from rl3d.parallel.layout import ParallelLayout
    from rl3d.single_controller.batch import DataBatch
    from rl3d.workers.context import RoleContext
    from rl3d.workers.roles import ActorRolloutWorker

    cfg = load_config(HERE / "rl3d_step.yaml", [f"data.train_files=[{prompts_path}]"]).config
    groups = init_megatron(ParallelLayout(1, 1, 1), seed=cfg.trainer.seed)
    actor = ActorRolloutWorker(RoleContext(cfg, spec_of(cfg.model), groups, tokenizer=None))
    tok = AutoTokenizer.from_pretrained(ensure_model("smollm2-135m"))
    texts = pq.read_table(prompts_path)["prompt"].to_pylist()[: cfg.data.prompts_per_step]
    ids = [tok.encode(t) for t in texts]
    actor.reshard()
    batch = actor.generate_sequences(
        DataBatch(meta={"prompt_ids": ids, "uid": list(range(len(ids)))}), step=0
    )
    actor.release_generation()
    signs = torch.tensor([1.0, -1.0]).repeat(len(batch) // 2)[:, None]
    return actor, batch.set("advantages", signs * batch["response_mask"])


def ab(actor, batch, pairs: int) -> None:
    """Without, then with `response_outputs`, `pairs` times: each call's wall and CPU seconds,
    then the medians and their ratio (with / without)."""
    import statistics

    calls = {"update_actor": actor.update_actor, "compute_log_prob": actor.compute_log_prob}
    took = {(name, flag): [] for name in calls for flag in (False, True)}
    for pair in range(pairs):
        for flag in (False, True):
            actor.role.batches.response_outputs = flag
            for name, call in calls.items():
                wall, cpu = time.perf_counter(), time.process_time()
                call(batch)
                wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                took[(name, flag)].append((wall, cpu))
                print(
                    f"pair {pair} {name} response_outputs={flag}: {wall:.2f} s, {cpu:.2f} CPU-s "
                    f"(load {os.getloadavg()[0]:.1f})",
                    flush=True,
                )
    for name in calls:
        off = [statistics.median(x) for x in zip(*took[(name, False)])]
        on = [statistics.median(x) for x in zip(*took[(name, True)])]
        print(
            f"{name}: median wall {off[0]:.2f} -> {on[0]:.2f} s ({on[0] / off[0]:.2f}x), "
            f"CPU {off[1]:.2f} -> {on[1]:.2f} s ({on[1] / off[1]:.2f}x)"
        )
    logp = {}  # both at the same weights (every update above moved them)
    for flag in (False, True):
        actor.role.batches.response_outputs = flag
        logp[flag] = actor.compute_log_prob(batch)["old_logp"]
    mask = batch["response_mask"].bool()
    gap = (logp[True] - logp[False])[mask].abs().max().item()
    print(f"max |logp difference| over response tokens: {gap:.3g}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", nargs="?", choices=("torch", "cprofile", "ab"), default="torch")
    parser.add_argument("--prompts", default="/tmp/rl3d_real_model_step/prompts.parquet")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--pairs", type=int, default=2)
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("gloo", rank=0, world_size=1, timeout=datetime.timedelta(seconds=900))
    torch.set_num_threads(args.threads)
    actor, batch = build_actor(args.prompts)
    actor.update_actor(batch)  # warm-up
    if args.mode == "ab":
        ab(actor, batch, args.pairs)
        return dist.destroy_process_group()
    start = time.perf_counter()
    if args.mode == "torch":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            actor.update_actor(batch)
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
    else:
        import cProfile
        import io
        import pstats

        profiler = cProfile.Profile()
        profiler.runcall(actor.update_actor, batch)
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(40)
        table = out.getvalue()
    print(f"update_actor {time.perf_counter() - start:.2f} s (load {os.getloadavg()[0]:.1f})\n{table}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
