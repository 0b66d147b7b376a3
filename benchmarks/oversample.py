"""Over-sampling on a separate rollout rank with skewed response lengths: throughput with and
without `rollout.async.oversample`, side by side in one run.

Runs `recipes/quickstart_cpu_grpo_async.yaml` (one training rank, one rollout rank, max_staleness
1) where a few of the 256 token ids stop a response (`--stop-ids`, ids 200, 201, ...), so the
tiny random model's response lengths are about geometric with a long tail up to
`--max-new-tokens`: a step's batch waits for its longest responses. The runs alternate (off,
on, off, on, ...: `--repeats` pairs) so that the machine's load drifts over both alike. Per run:
wall seconds per step over the steps after `--warmup` (the metrics' wall-clock stamps), trained
samples per second (`SHAPE`: 2 prompts x 4 samples a step), the rollout rank's generation
seconds per step and its engine's work per trained sample (decode forwards and rows decoded:
what the time follows on an idle machine, whatever the load), mean response length, staleness,
groups carried and trained later. Writes `oversample.csv`, `oversample.md` (the table, the
ratio on/off, the command and the load average before and after) and `oversample.png` into
`--out`.

    python benchmarks/oversample.py                       # 2 pairs x 16 steps
    python benchmarks/oversample.py --factor 1.5 --repeats 3
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
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes/quickstart_cpu_grpo_async.yaml"
# A small batch (2 prompts x 4 samples): decoding, one forward per token whatever the rows, then
# costs more than the update (with the recipe's 8 prompts x 4, training dominates on CPU and the
# rollout rank's time is hidden behind it at max_staleness 1).
SHAPE = ("data.prompts_per_step=2", "actor.mini_batch_size=8", "actor.micro_batch_size=8")
COLUMNS = ("run", "oversample", "steps", "wall_per_step_s", "samples_per_s", "generate_s", "decode_steps",
           "decode_rows", "length_mean",
           "length_max", "staleness_mean", "carried_trained", "stale_dropped", "reward_mean")  # fmt: skip


def run_one(factor: float, args, run_dir: Path) -> dict:
    stops = ",".join(str(200 + i) for i in range(args.stop_ids))
    cmd = [sys.executable, "-m", "rl3d.cli", "train", str(RECIPE), f"trainer.run_dir={run_dir}"]
    cmd += [f"trainer.total_steps={args.steps}", f"rollout.max_new_tokens={args.max_new_tokens}"]
    cmd += [f"rollout.stop_token_ids=[{stops}]", "checkpoint.save_every=0", "logging.tensorboard=false"]
    if factor > 1:
        cmd.append(f"rollout.async.oversample={factor}")
    cmd += [*SHAPE, *args.overrides, "--overwrite"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"oversample={factor} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = sorted({r["step"]: r for r in rows}.values(), key=lambda r: r["step"])
    timed = rows[args.warmup :]
    resolved = yaml.safe_load((run_dir / "resolved_config.yaml").read_text())
    samples = resolved["data"]["prompts_per_step"] * resolved["rollout"]["n"]
    wall = (timed[-1]["time"] - rows[args.warmup - 1]["time"]) / len(timed)

    def mean(key: str) -> float:
        return statistics.fmean(r.get(key, 0.0) for r in timed)

    return {
        "oversample": factor,
        "steps": len(timed),
        "wall_per_step_s": wall,
        "samples_per_s": samples / wall,
        "generate_s": mean("async/rollout_generate_s"),
        # the engine's work per trained sample, whatever the load: forwards and rows decoded
        "decode_steps": sum(r["async/rollout_decode_steps"] for r in timed) / (samples * len(timed)),
        "decode_rows": sum(r["async/rollout_decode_rows"] for r in timed) / (samples * len(timed)),
        "length_mean": mean("response/length_mean"),
        "length_max": max(r.get("response/length_max", 0.0) for r in timed),
        "staleness_mean": mean("async/staleness_mean"),
        "carried_trained": sum(r.get("rollout/carried_trained", 0.0) for r in timed),
        "stale_dropped": sum(r.get("rollout/stale_dropped", 0.0) for r in timed),
        "reward_mean": mean("reward/score_mean"),
    }


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    labels = [f"pair {r['run'] + 1}\n{'x' + format(r['oversample'], 'g') if r['oversample'] > 1 else 'off'}"
              for r in rows]  # fmt: skip
    colors = ["tab:blue" if r["oversample"] > 1 else "tab:gray" for r in rows]
    ax.bar(range(len(rows)), [r["samples_per_s"] for r in rows], color=colors)
    ax.set_xticks(range(len(rows)), labels)
    ax.set_ylabel("trained samples / s")
    ax.set_title("over-sampling with skewed response lengths")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="key=value overrides for every run")
    parser.add_argument("--factor", type=float, default=2.0, help="rollout.async.oversample of the 'on' runs")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of the timing")
    parser.add_argument("--repeats", type=int, default=2, help="pairs of (off, on) runs")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--stop-ids", type=int, default=4, help="how many token ids stop a response")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/oversample")
    args = parser.parse_args(argv)
    load_before = os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            for factor in (1.0, args.factor):
                start = time.monotonic()
                row = {"run": i} | run_one(factor, args, Path(tmp) / f"o{factor:g}_{i}")
                rows.append(row)
                print(  # noqa: T201 - progress of a benchmark script
                    f"pair {i + 1}/{args.repeats} oversample={factor:g}: "
                    f"{row['wall_per_step_s']:.3f} s/step, "
                    f"{row['samples_per_s']:.1f} samples/s (generate {row['generate_s']:.3f} s; "
                    f"{time.monotonic() - start:.0f} s)",
                    flush=True,
                )
    load_after = os.getloadavg()
    off = statistics.fmean(r["samples_per_s"] for r in rows if r["oversample"] == 1)
    on = statistics.fmean(r["samples_per_s"] for r in rows if r["oversample"] > 1)
    steps = {
        f: statistics.fmean(r["decode_steps"] for r in rows if (r["oversample"] > 1) == f) for f in (0, 1)
    }
    pairs = [b["samples_per_s"] / a["samples_per_s"] for a, b in zip(rows[::2], rows[1::2])]
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "oversample.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    plot(rows, args.out / "oversample.png")
    command = shlex.join(
        ["python", "benchmarks/oversample.py", *(argv if argv is not None else sys.argv[1:])]
    )
    lines = [
        "| pair | oversample | wall s/step | samples/s | generate s | decode steps / sample | "
        "decode rows / sample | length mean | length max | "
        "staleness | carried, trained | stale dropped | reward |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        *(
            f"| {r['run'] + 1} | {r['oversample']:g} | {r['wall_per_step_s']:.3f} | "
            f"{r['samples_per_s']:.1f} | "
            f"{r['generate_s']:.3f} | {r['decode_steps']:.2f} | {r['decode_rows']:.1f} | "
            f"{r['length_mean']:.1f} | {r['length_max']:.0f} | "
            f"{r['staleness_mean']:.2f} | {r['carried_trained']:.0f} | {r['stale_dropped']:.0f} | "
            f"{r['reward_mean']:.3f} |"
            for r in rows
        ),
        "",
        f"trained samples per second, oversample {args.factor:g} / off: {on / off:.2f} (mean {on:.1f} / "
        f"{off:.1f}; per pair {', '.join(f'{p:.2f}' for p in pairs)}); decode forwards per trained sample "
        f"{steps[1]:.2f} / {steps[0]:.2f} = {steps[1] / steps[0]:.2f}",
        f"load average (1, 5, 15 min) before {load_before[0]:.1f} {load_before[1]:.1f} {load_before[2]:.1f}, "
        f"after {load_after[0]:.1f} {load_after[1]:.1f} {load_after[2]:.1f}; {os.cpu_count()} cores",
        f"command: `{command}`",
    ]
    (args.out / "oversample.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[-3:]))  # noqa: T201
    return 0


if __name__ == "__main__":
    sys.exit(main())
