"""Profile rl3d's actor update on SmolLM2-135M-Instruct in one process, the step of
benchmarks/real_model_step.py (4 prompts x 8 samples x 12 tokens, one optimizer step):

    python benchmarks/real_model_step/profile_update.py [torch|cprofile|ab]

prints the torch profiler's op table (or cProfile's) of one `update_actor` after a warm-up one;
`ab` times `update_actor` alternately without and with the output layer cut to the response
positions (`MegatronEngine.batches.response_outputs`), two pairs.
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", nargs="?", choices=("torch", "cprofile", "ab"), default="torch")
    parser.add_argument("--prompts", default="/tmp/rl3d_real_model_step/prompts.parquet")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("gloo", rank=0, world_size=1, timeout=datetime.timedelta(seconds=900))
    torch.set_num_threads(args.threads)
    actor, batch = build_actor(args.prompts)
    actor.update_actor(batch)  # warm-up
    if args.mode == "ab":
        for pair in range(2):
            for flag in (False, True):
                actor.role.batches.response_outputs = flag
                start = time.perf_counter()
                actor.update_actor(batch)
                took = time.perf_counter() - start
                print(f"pair {pair} response_outputs={flag}: {took:.2f} s (load {os.getloadavg()[0]:.1f})")
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
