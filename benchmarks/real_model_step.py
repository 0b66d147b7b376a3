"""rl3d's GRPO step against TRL's `GRPOTrainer` on the real SmolLM2-135M-Instruct, on CPU.

    python benchmarks/real_model_step.py --runs 3 --steps 4

Both sides run one process on the same HF directory (`rl3d models fetch smollm2-135m`), the
same chat-templated prompts (a string column, so neither side templates again), the same
samples per prompt and completion length, every completion forced to that length (rl3d: no
stop token; TRL: `min_new_tokens`), no reference model (KL coefficient / beta 0), and one
optimizer step over the step's samples in one forward/backward. A step is generation,
scoring, the loss and the optimizer step (TRL: `on_step_begin` to `on_step_end`; rl3d:
`time/step`, the sum of its stages, whose parts are reported beside it). The first step of
each run (warm-up) is left out. Runs alternate rl3d / TRL so both see the same machine load,
which is logged with each run.

TRL runs in its own virtual environment, `.venv-trl/`, made on first use with CPU
`torch==2.13.0` installed first and pinned by a constraints file (pip never pulls a CUDA
build). Outputs: benchmarks/real_model_step/{steps.csv, summary.md, steps.png}.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HERE = ROOT / "benchmarks" / "real_model_step"
VENV = ROOT / ".venv-trl"
TRL_PINS = ("trl==1.16.0", "transformers==5.24.0", "accelerate==1.15.0")
PROMPTS_PER_STEP, N, NEW_TOKENS = 4, 8, 12
STAGES = ("generate", "advantage", "update_actor", "reshard")


def digit_reward(inp) -> float:
    """rl3d's reward: the share of digits in the response (cheap, the same as TRL's below)."""
    text = inp.response_text
    return sum(c.isdigit() for c in text) / max(len(text), 1)


def trl_digit_reward(completions, **kwargs) -> list[float]:
    return [sum(c.isdigit() for c in t) / max(len(t), 1) for t in completions]


# -- the data: the same chat-templated prompt strings for both -------------------------------
def write_prompts(model_dir: Path, out: Path, count: int = 64) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    rows = []
    for i in range(count):
        a, b = 3 + (7 * i) % 40, 2 + (11 * i) % 30
        question = f"Tom has {a} apples and buys {b} more. How many apples does he have now?"
        text = tok.apply_chat_template(
            [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
        )
        rows.append({"prompt": text, "answer": str(a + b)})
    path = out / "prompts.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


# -- TRL's side (runs inside .venv-trl; imports neither rl3d nor this repo's packages) --------
def trl_worker(args: argparse.Namespace) -> None:
    # TRL's environment holds packages rl3d's does not (tests/unit/test_no_shadowing.py checks only
    # rl3d's): take this script's folder off the path before importing them
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(1)
    data = Dataset.from_parquet(args.data).select_columns(["prompt"])
    seconds, starts = [], []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            starts.append(time.perf_counter())

        def on_step_end(self, *a, **k):
            seconds.append(time.perf_counter() - starts[-1])

    config = GRPOConfig(
        output_dir=args.out_dir,
        per_device_train_batch_size=PROMPTS_PER_STEP * N,
        gradient_accumulation_steps=1,
        num_generations=N,
        max_completion_length=NEW_TOKENS,
        generation_kwargs={"min_new_tokens": NEW_TOKENS},
        beta=0.0,
        learning_rate=1e-6,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=1.0,
        max_steps=args.steps,
        num_iterations=1,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        use_cpu=True,
        bf16=False,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        seed=1,
        dataloader_num_workers=0,
    )
    trainer = GRPOTrainer(
        model=args.model,
        reward_funcs=trl_digit_reward,
        args=config,
        train_dataset=data,
        callbacks=[StepTimer()],
    )
    trainer.train()
    lengths = [
        r["completions/mean_length"] for r in trainer.state.log_history if "completions/mean_length" in r
    ]
    Path(args.result).write_text(
        json.dumps({"seconds": seconds, "lengths": lengths, "threads": torch.get_num_threads()})
    )


# -- driver -----------------------------------------------------------------------------------
def ensure_trl_venv() -> Path:
    """.venv-trl with CPU torch 2.13.0 pinned first, then TRL; made once."""
    python = VENV / "bin" / "python"
    if python.exists() and subprocess.run([python, "-c", "import trl"], capture_output=True).returncode == 0:
        return python
    subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    pin = VENV / "pin.txt"
    pin.write_text("torch==2.13.0\n")
    pip = [str(python), "-m", "pip", "install", "-q", "-c", str(pin)]
    subprocess.run([*pip, "torch==2.13.0"], check=True)
    subprocess.run([*pip, *TRL_PINS], check=True)
    return python


def load_avg() -> float:
    return os.getloadavg()[0]


def run_rl3d(data: Path, run_dir: Path, steps: int, env: dict) -> dict:
    cmd = [sys.executable, "-m", "rl3d.cli", "train", str(HERE / "rl3d_step.yaml")]
    cmd += [f"data.train_files=[{data}]", f"trainer.run_dir={run_dir}", f"trainer.total_steps={steps}"]
    cmd += [*rl3d_extra_overrides(), "--overwrite"]
    env = env | {"PYTHONPATH": os.pathsep.join([str(ROOT / "benchmarks"), env.get("PYTHONPATH", "")])}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{shlex.join(cmd)} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = sorted(rows, key=lambda r: r["step"])
    return {
        "seconds": [r["time/step"] for r in rows],
        "stages": [{s: r.get(f"time/{s}", 0.0) for s in STAGES} for r in rows],
        "lengths": [r.get("response/length_mean", float("nan")) for r in rows],
        "reshard_bytes": [r.get("reshard/bytes", 0) for r in rows],
        "reshard_peak": [r.get("reshard/peak_bytes", 0) for r in rows],
    }


def rl3d_extra_overrides() -> list[str]:
    """`rollout.ignore_eos` where rl3d has it (EOS stops generation by default there)."""
    from rl3d.config.schema import RolloutConfig

    return ["rollout.ignore_eos=true"] if "ignore_eos" in RolloutConfig.__dataclass_fields__ else []


def run_trl(python: Path, model: Path, data: Path, out_dir: Path, steps: int, env: dict) -> dict:
    result = out_dir / "trl.json"
    cmd = [str(python), __file__, "--trl-worker", "--model", str(model), "--data", str(data)]
    cmd += ["--out-dir", str(out_dir), "--result", str(result), "--steps", str(steps)]
    env = {k: v for k, v in env.items() if k != "PYTHONPATH"}  # nothing of rl3d's environment
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{shlex.join(cmd)} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(result.read_text())


def median_spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def write_outputs(rows: list[dict], runs: list[dict], command: str) -> None:
    HERE.mkdir(parents=True, exist_ok=True)
    with open(HERE / "steps.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    timed = [r for r in rows if r["step"] > 1]
    by = {side: [r["seconds"] for r in timed if r["side"] == side] for side in ("rl3d", "trl")}
    rl3d_med, trl_med = statistics.median(by["rl3d"]), statistics.median(by["trl"])
    lines = [
        f"Command: `{command}`",
        "",
        f"{PROMPTS_PER_STEP} prompts x {N} samples x {NEW_TOKENS} new tokens per step, SmolLM2-135M-Instruct "
        f"fp32, one process each, {len(runs) // 2} interleaved runs per side, steps 2.. of each run.",
        "",
        "| side | median step s (min-max) | steps timed |",
        "|---|---|---|",
        f"| rl3d | {median_spread(by['rl3d'])} | {len(by['rl3d'])} |",
        f"| TRL GRPOTrainer | {median_spread(by['trl'])} | {len(by['trl'])} |",
        "",
        f"Ratio of medians rl3d / TRL: **{rl3d_med / trl_med:.2f}** (below 1: rl3d faster).",
        "",
        "rl3d's step by stage (median s over the same steps):",
        "",
        "| " + " | ".join(STAGES) + " |",
        "|" + "---|" * len(STAGES),
        "| "
        + " | ".join(f"{statistics.median(r[s] for r in timed if r['side'] == 'rl3d'):.2f}" for s in STAGES)
        + " |",
        "",
        "Per run (machine load = 1-minute load average on 2 cores, before the run):",
        "",
        "| run | side | load | median step s | completion length |",
        "|---|---|---|---|---|",
    ]
    for r in runs:
        lines.append(
            f"| {r['run']} | {r['side']} | {r['load']:.1f} | {statistics.median(r['seconds'][1:]):.2f} | "
            f"{r['length']:.1f} |"
        )
    (HERE / "summary.md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.boxplot([by["rl3d"], by["trl"]], tick_labels=["rl3d", "TRL GRPOTrainer"])
    ax.set_ylabel("step seconds")
    ax.set_title(f"GRPO step, SmolLM2-135M, {PROMPTS_PER_STEP}x{N}x{NEW_TOKENS} tokens, CPU")
    fig.tight_layout()
    fig.savefig(HERE / "steps.png", dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="runs per side, interleaved")
    parser.add_argument("--steps", type=int, default=4, help="steps per run (the first is warm-up)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads on both sides")
    parser.add_argument("--work", default="/tmp/rl3d_real_model_step", help="scratch directory")
    parser.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--out-dir", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_worker:
        return trl_worker(args)
    if args.steps < 2:
        raise SystemExit("--steps must be >= 2 (the first step of a run is warm-up)")
    from rl3d.models.hub import ensure_model

    model = ensure_model("smollm2-135m")
    python = ensure_trl_venv()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    data = write_prompts(model, work)
    env = dict(os.environ) | {"OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false"}
    rows, runs = [], []
    for run in range(1, args.runs + 1):
        for side in ("rl3d", "trl"):
            load = load_avg()
            out = work / f"{side}{run}"
            if side == "rl3d":
                got = run_rl3d(data, out, args.steps, env)
            else:
                out.mkdir(parents=True, exist_ok=True)
                got = run_trl(python, model, data, out, args.steps, env)
            length = statistics.fmean(got["lengths"]) if got["lengths"] else float("nan")
            runs.append({"run": run, "side": side, "load": load, "seconds": got["seconds"], "length": length})
            for step, seconds in enumerate(got["seconds"], start=1):
                row = {
                    "run": run,
                    "side": side,
                    "step": step,
                    "seconds": round(seconds, 4),
                    "load": round(load, 2),
                }
                stages = got.get("stages", [{}] * len(got["seconds"]))[step - 1]
                rows.append(row | {s: round(stages.get(s, 0.0), 4) for s in STAGES})
            print(f"run {run} {side}: {[round(s, 2) for s in got['seconds']]} (load {load:.1f})", flush=True)
    command = "python benchmarks/real_model_step.py " + " ".join(sys.argv[1:])
    write_outputs(rows, runs, command.strip())
    print((HERE / "summary.md").read_text())


if __name__ == "__main__":
    main()
