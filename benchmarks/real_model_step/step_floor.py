"""rl3d's GRPO step on SmolLM2-135M-Instruct (the step of benchmarks/real_model_step.py: 4 prompts
x 8 samples x 12 tokens, one optimizer step) stage by stage against this machine's floor:

    python benchmarks/real_model_step/step_floor.py [--repeats 2] [--out floor.csv]

For each stage (generation, old log-probs, reference log-probs, the update's forward+backward,
the optimizer step) it counts the matmul FLOPs from the model's shapes and the step's batch,
times `torch.mm` / `torch.bmm` at exactly those shapes (fp32, the same threads), and reports
the floor two ways: FLOPs at the best measured matmul rate (the peak), and the sum of the
stage's matmuls each at its own measured time (the floor at the step's shapes: a decode step's
[32, 576] x [576, 49152] runs far below the peak). The optimizer is bandwidth-bound: its floor is
its bytes (Adam reads parameter, gradient and both moments, writes three; the clip reads the
gradients once more) at the measured copy bandwidth. Beside each floor the stage's measured
time (median of `--repeats` after a warm-up), the ratio, and the process's minor page faults and
system seconds in the stage. Writes the CSV (`--out`, default floor.csv next to this file) and
a PNG beside it. Reads the prompts benchmarks/real_model_step.py writes (`--prompts`).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import resource
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent


def _time(fn, repeats: int = 3) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


class ShapeClock:
    """Measured seconds of one fp32 matmul at each shape asked, memoised."""

    def __init__(self):
        self.seconds: dict[tuple, float] = {}

    def mm(self, m: int, k: int, n: int) -> float:
        key = ("mm", m, k, n)
        if key not in self.seconds:
            a, b = torch.randn(m, k), torch.randn(k, n)
            self.seconds[key] = _time(lambda: torch.mm(a, b))
        return self.seconds[key]

    def bmm(self, batch: int, m: int, k: int, n: int) -> float:
        key = ("bmm", batch, m, k, n)
        if key not in self.seconds:
            a, b = torch.randn(batch, m, k), torch.randn(batch, k, n)
            self.seconds[key] = _time(lambda: torch.bmm(a, b))
        return self.seconds[key]

    def peak(self) -> float:
        """The best rate (FLOP/s) over every shape timed."""
        rates = []
        for key, seconds in self.seconds.items():
            dims = key[1:] if key[0] == "bmm" else (1, *key[1:])
            b, m, k, n = dims
            rates.append(2 * b * m * k * n / seconds)
        return max(rates)


class Account:
    """FLOPs and the floor at the measured shapes of one stage."""

    def __init__(self, clock: ShapeClock):
        self.clock, self.flops, self.floor = clock, 0, 0.0

    def mm(self, m: int, k: int, n: int, times: int = 1) -> None:
        self.flops += times * 2 * m * k * n
        self.floor += times * self.clock.mm(m, k, n)

    def bmm(self, batch: int, m: int, k: int, n: int, times: int = 1) -> None:
        self.flops += times * 2 * batch * m * k * n
        self.floor += times * self.clock.bmm(batch, m, k, n)


def linears(spec) -> list[tuple[int, int]]:
    """(in, out) of one decoder layer's linears: QKV, the attention projection, fc1 (SwiGLU: two
    halves), fc2."""
    h, d = spec.hidden_size, spec.head_dim
    heads, kv = spec.num_attention_heads, spec.num_query_groups
    return [
        (h, (heads + 2 * kv) * d),
        (heads * d, h),
        (h, 2 * spec.ffn_hidden_size),
        (spec.ffn_hidden_size, h),
    ]


def forward(acc: Account, spec, rows: int, seq: int, out_rows: int, *, backward: bool = False) -> None:
    """A forward (or its backward: the input's and the weight's gradients) over `rows` sequences
    of `seq` positions, the output layer on `out_rows` positions in all."""
    tokens, heads, d = rows * seq, spec.num_attention_heads, spec.head_dim
    for k, n in linears(spec):
        if backward:
            acc.mm(tokens, n, k, spec.num_layers)  # input gradient
            acc.mm(k, tokens, n, spec.num_layers)  # weight gradient
        else:
            acc.mm(tokens, k, n, spec.num_layers)
    per_pass = 2 if backward else 1  # the backward of each product is two products
    acc.bmm(rows * heads, seq, d, seq, spec.num_layers * per_pass)  # Q K^T (megatron's local attention)
    acc.bmm(rows * heads, seq, seq, d, spec.num_layers * per_pass)  # softmax x V
    V, h = spec.vocab_size, spec.hidden_size
    if backward:
        acc.mm(out_rows, V, h)
        acc.mm(V, out_rows, h)
    else:
        acc.mm(out_rows, h, V)


def generation(acc: Account, spec, rows: int, prompt: int, new: int) -> None:
    """Prefill over the prompts (the output layer on the last position), then `new - 1` decode
    steps of one token per sequence against the KV cache."""
    forward(acc, spec, rows, prompt, rows)
    heads, d = spec.num_attention_heads, spec.head_dim
    for step in range(1, new):
        for k, n in linears(spec):
            acc.mm(rows, k, n, spec.num_layers)
        acc.bmm(rows * heads, 1, d, prompt + step, spec.num_layers)
        acc.bmm(rows * heads, 1, prompt + step, d, spec.num_layers)
        acc.mm(rows, spec.hidden_size, spec.vocab_size)


def copy_bandwidth() -> float:
    """Bytes/s of an fp32 add over 32M elements (two read, one written)."""
    n = 32 << 20
    a, b, c = torch.randn(n), torch.randn(n), torch.empty(n)
    return 12 * n / _time(lambda: torch.add(a, b, out=c))


def build(prompts_path: str):
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

    overrides = [f"data.train_files=[{prompts_path}]", "rollout.ignore_eos=true"]
    cfg = load_config(HERE / "rl3d_step.yaml", overrides).config
    groups = init_megatron(ParallelLayout(1, 1, 1), seed=cfg.trainer.seed)
    spec = spec_of(cfg.model)
    actor = ActorRolloutWorker(RoleContext(cfg, spec, groups, tokenizer=None))
    tok = AutoTokenizer.from_pretrained(ensure_model("smollm2-135m"))
    texts = pq.read_table(prompts_path)["prompt"].to_pylist()[: cfg.data.prompts_per_step]
    ids = [tok.encode(t) for t in texts]
    prompts = DataBatch(meta={"prompt_ids": ids, "uid": list(range(len(ids)))})
    return actor, spec, prompts


class Stage:
    """Wall seconds, minor page faults and system seconds of each call of a stage."""

    def __init__(self):
        self.wall, self.faults, self.system = [], [], []

    def __enter__(self):
        self._usage, self._start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.wall.append(time.perf_counter() - self._start)
        usage = resource.getrusage(resource.RUSAGE_SELF)
        self.faults.append(usage.ru_minflt - self._usage.ru_minflt)
        self.system.append(usage.ru_stime - self._usage.ru_stime)


def measure(actor, prompts, repeats: int) -> tuple[dict[str, Stage], object]:
    """Generation, old log-probs and the update, a warm-up call then `repeats` timed ones; the
    optimizer step timed inside the update (megatron's `optimizer.step`, the clip's norm in it)."""
    optimizer = actor.role.optimizer
    inner, optimizer_s = optimizer.step, []

    def timed_step(*args, **kwargs):
        start = time.perf_counter()
        out = inner(*args, **kwargs)
        optimizer_s.append(time.perf_counter() - start)
        return out

    optimizer.step = timed_step
    stages = {name: Stage() for name in ("generation", "old_logp", "update")}
    batch = None
    for call in range(repeats + 1):
        warm = call == 0
        actor.reshard()
        with Stage() if warm else stages["generation"]:
            batch = actor.generate_sequences(prompts, step=call)
        actor.release_generation()
        signs = torch.tensor([1.0, -1.0]).repeat(len(batch) // 2)[:, None]
        batch = batch.set("advantages", signs * batch["response_mask"])
        with Stage() if warm else stages["old_logp"]:
            batch = batch.set("old_logp", actor.compute_log_prob(batch)["old_logp"])
        with Stage() if warm else stages["update"]:
            actor.update_actor(batch)
        print(
            f"call {call}: " + ", ".join(f"{k} {v.wall[-1]:.2f} s" for k, v in stages.items() if v.wall),
            flush=True,
        )
    stages["optimizer"] = Stage()
    stages["optimizer"].wall = optimizer_s[1:]
    return stages, batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", default="/tmp/rl3d_real_model_step/prompts.parquet")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=str(HERE / "floor.csv"))
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29519")
    dist.init_process_group("gloo", rank=0, world_size=1, timeout=datetime.timedelta(seconds=900))
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    actor, spec, prompts = build(args.prompts)
    stages, batch = measure(actor, prompts, args.repeats)
    rows, width = batch["input_ids"].shape
    new = batch["response_mask"].shape[1]
    prompt = width - new

    clock = ShapeClock()
    acc = {name: Account(clock) for name in ("generation", "old_logp", "ref_logp", "update_fwd_bwd")}
    generation(acc["generation"], spec, rows, prompt, new)
    for name in ("old_logp", "ref_logp"):
        forward(acc[name], spec, rows, width, rows * new)
    forward(acc["update_fwd_bwd"], spec, rows, width, rows * new)
    forward(acc["update_fwd_bwd"], spec, rows, width, rows * new, backward=True)
    peak = clock.peak()
    bandwidth = copy_bandwidth()
    params = sum(p.numel() for p in actor.role.unwrapped().parameters())
    optimizer_bytes = 32 * params  # Adam: reads p, g, m, v, writes p, m, v; the clip reads g

    update = stages["update"]
    fwd_bwd = Stage()
    fwd_bwd.wall = [u - o for u, o in zip(update.wall, stages["optimizer"].wall)]
    fwd_bwd.faults, fwd_bwd.system = update.faults, update.system
    measured = {
        "generation": stages["generation"],
        "old_logp": stages["old_logp"],
        "ref_logp": None,  # no reference in this step (algorithm.kl.coef 0, as TRL's beta 0)
        "update_fwd_bwd": fwd_bwd,
        "optimizer": stages["optimizer"],
    }
    load_after = os.getloadavg()[0]
    table = []
    for name, stage in measured.items():
        if name == "optimizer":
            flops, floor_peak = 0, optimizer_bytes / bandwidth
            floor_shapes = floor_peak
        else:
            flops, floor_shapes = acc[name].flops, acc[name].floor
            floor_peak = flops / peak
        wall = statistics.median(stage.wall) if stage is not None and stage.wall else float("nan")
        table.append(
            {
                "stage": name,
                "gflop": round(flops / 1e9, 2),
                "floor_at_peak_s": round(floor_peak, 3),
                "floor_at_shapes_s": round(floor_shapes, 3),
                "measured_s": round(wall, 3),
                "measured_over_floor_at_shapes": round(wall / floor_shapes, 2),
                "minor_faults": int(statistics.median(stage.faults))
                if stage is not None and stage.faults
                else "",
                "system_s": round(statistics.median(stage.system), 2)
                if stage is not None and stage.system
                else "",
                "peak_gflops": round(peak / 1e9, 1),
                "copy_gbps": round(bandwidth / 1e9, 1),
                "load_before_after": f"{load_before:.1f}/{load_after:.1f}",
                "malloc_env": " ".join(
                    f"{k}={v}" for k, v in os.environ.items() if k.startswith(("MALLOC_", "THP_"))
                ),
            }
        )
    out = Path(args.out)
    with out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(table[0]))
        writer.writeheader()
        writer.writerows(table)
    for row in table:
        print(row)
    print(f"batch {rows} x {width} ({prompt} prompt + {new} new); params {params}; wrote {out}")
    plot(table, out.with_suffix(".png"))
    dist.destroy_process_group()


def plot(table: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["stage"] for r in table]
    x = range(len(names))
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar([i - 0.27 for i in x], [r["floor_at_peak_s"] for r in table], 0.27, label="floor at peak")
    ax.bar(list(x), [r["floor_at_shapes_s"] for r in table], 0.27, label="floor at the step's shapes")
    ax.bar([i + 0.27 for i in x], [r["measured_s"] for r in table], 0.27, label="measured (median)")
    ax.set_xticks(list(x), names)
    ax.set_ylabel("seconds")
    ax.set_title(f"SmolLM2-135M GRPO step by stage, fp32, 2 threads (load {table[0]['load_before_after']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
