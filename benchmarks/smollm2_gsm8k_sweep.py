"""The real-model quickstart over seeds: does GRPO on SmolLM2-135M-Instruct learn the GSM8K-style
task on 2 CPU cores, and what could the model do before RL?

    python benchmarks/smollm2_gsm8k_sweep.py --seeds 1 2 3 [overrides]
    python benchmarks/smollm2_gsm8k_sweep.py --pre-rl 64 --samples 4

A sweep runs `rl3d train recipes/quickstart_cpu_smollm2_gsm8k.yaml trainer.seed=S [overrides]`
once per seed, one run at a time, and writes into `--out` (per `--name`):
- `<name>.csv`: per seed, the mean reward, exact-answer rate (`gsm8k/exact`) and format rate
  (`gsm8k/format`) over the first and the last 5 steps, the training time (sum of `time/step`),
  the wall time and the machine's load average while it ran;
- `<name>_steps.csv`: every step of every seed;
- `<name>.md`: the table with its spread (min / mean / max) and the command; `<name>.png`: the curves.

The goal: in every seed the last-5 mean reward is at least 0.2 above the first-5, in under 20
minutes of training. `--pre-rl N` instead scores the model as it is (transformers, the recipe's
system prompt, response length and temperature) on N validation problems, greedy and with
`--samples` samples each, into `pre_rl.md`.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from demo_sweep import spread, train_run, write_seed_csv  # noqa: E402 - shared with the demo sweep

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes/quickstart_cpu_smollm2_gsm8k.yaml"
WINDOW = 5
GOAL_GAIN, GOAL_TRAIN_S = 0.2, 1200.0
KEYS = {"reward": "reward/score_mean", "exact": "gsm8k/exact", "format": "gsm8k/format"}
COLUMNS = ["seed", "steps"]
COLUMNS += [f"{k}_{w}" for k in KEYS for w in ("first5", "last5")]
COLUMNS += ["gain", "train_s", "wall_s", "load_avg", "meets_goal"]


def run_seed(recipe: Path, seed: int, overrides: list[str], run_dir: Path) -> dict:
    load_before = os.getloadavg()[0]
    steps, wall = train_run(recipe, run_dir, [f"trainer.seed={seed}", *overrides])
    rates_from_samples(run_dir, steps)
    row: dict = {"seed": seed, "steps": len(steps), "curves": {}}
    for name, key in KEYS.items():
        values = [r[key] for r in steps]
        row["curves"][name] = values
        row[f"{name}_first5"] = statistics.fmean(values[:WINDOW])
        row[f"{name}_last5"] = statistics.fmean(values[-WINDOW:])
    row["gain"] = row["reward_last5"] - row["reward_first5"]
    row["train_s"] = sum(r.get("time/step", 0.0) for r in steps)
    row["wall_s"] = wall
    row["load_avg"] = (load_before + os.getloadavg()[0]) / 2  # 1-minute load at start and end
    row["meets_goal"] = row["gain"] >= GOAL_GAIN and row["train_s"] < GOAL_TRAIN_S
    row["step_rows"] = steps
    return row


def rates_from_samples(run_dir: Path, steps: list[dict]) -> None:
    """With `logging.samples` at least a step's responses, read `gsm8k/exact` and `gsm8k/format`
    from the text in samples.jsonl: right for any reward (the hook reads them from the scores
    of `gsm8k_format_credit`, and cannot see the format under the strict `gsm8k`)."""
    import yaml
    from rl3d.rewards.rule_based import extract_gsm8k_answer

    path = run_dir / "samples.jsonl"
    if not path.is_file():
        return
    cfg = yaml.safe_load((run_dir / "resolved_config.yaml").read_text())
    per_step = cfg["data"]["prompts_per_step"] * cfg["rollout"]["n"]
    by_step: dict[int, list[dict]] = {}
    for line in path.read_text().splitlines():
        sample = json.loads(line)
        if sample.get("split", "train") == "train":
            by_step.setdefault(sample["step"], []).append(sample)
    for row in steps:
        samples = by_step.get(row["step"], [])
        if len(samples) < per_step:  # logging.samples below the step's responses: keep the hook's
            continue
        row["gsm8k/format"] = statistics.fmean(
            extract_gsm8k_answer(s["response"], strict=True) is not None for s in samples
        )
        row["gsm8k/exact"] = statistics.fmean(s["reward"] == 1.0 for s in samples)


def write_outputs(out: Path, name: str, rows: list[dict], command: str, note: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_seed_csv(out / f"{name}.csv", COLUMNS, rows)
    with open(out / f"{name}_steps.csv", "w", newline="") as f:
        fields = ["seed", "step", *KEYS.values(), "response/length_mean", "time/step"]
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        for r in rows:
            for step in r["step_rows"]:
                writer.writerow({"seed": r["seed"], **step})
    header = "| seed | reward first-5 -> last-5 | exact first-5 -> last-5 | format first-5 -> last-5 |"
    lines = [
        f"# SmolLM2-135M-Instruct GSM8K-style sweep `{name}`",
        "",
        f"`{command}`",
        "",
        header + " gain | training s | wall s | load avg | goal |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = [f"{r[f'{k}_first5']:.3f} -> {r[f'{k}_last5']:.3f}" for k in KEYS]
        lines.append(
            f"| {r['seed']} | {' | '.join(cells)} | {r['gain']:+.3f} | {r['train_s']:.0f} | "
            f"{r['wall_s']:.0f} | {r['load_avg']:.1f} | {'yes' if r['meets_goal'] else 'no'} |"
        )
    cells = [f"{spread(rows, f'{k}_first5')} -> {spread(rows, f'{k}_last5')}" for k in KEYS]
    lines += [
        f"| min / mean / max | {' | '.join(cells)} | {spread(rows, 'gain')} | {spread(rows, 'train_s')} | "
        f"{spread(rows, 'wall_s')} | {spread(rows, 'load_avg')} | "
        f"{sum(r['meets_goal'] for r in rows)}/{len(rows)} |",
        "",
        f"Goal: in every seed the last-{WINDOW} mean reward >= the first-{WINDOW} + {GOAL_GAIN}, "
        f"training under {GOAL_TRAIN_S:.0f} s (2 CPU cores, shared; load avg = the 1-minute load "
        "average at the run's start and end, averaged).",
        *([note] if note else []),
    ]
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    _plot(out / f"{name}.png", name, rows)


def _plot(path: Path, name: str, rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6), sharey=True)
    for ax, key in zip(axes, KEYS):
        for r in rows:
            values = r["curves"][key]
            ax.plot(range(1, len(values) + 1), values, lw=1, label=f"seed {r['seed']}")
        ax.set_title(KEYS[key])
        ax.set_xlabel("step")
    axes[0].set_ylabel("mean over the step's responses")
    axes[0].set_ylim(0, 1.02)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"SmolLM2-135M GSM8K-style sweep: {name}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def pre_rl(recipe: Path, overrides: list[str], num: int, samples: int, out: Path, command: str) -> None:
    """Exact and format rates of the untrained model on `num` validation problems, as the recipe
    prompts it: greedy, and `samples` samples each at the recipe's temperature."""
    import pyarrow.parquet as pq
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rl3d.config import load_config
    from rl3d.models.hub import resolve_model_path
    from rl3d.rewards.rule_based import FORMAT_CREDIT, gsm8k_score

    cfg = load_config(recipe, overrides).config
    path = resolve_model_path(cfg.model.hf_path)
    tok = AutoTokenizer.from_pretrained(path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rows = pq.read_table(cfg.data.val_files[0]).to_pylist()[:num]
    system = [{"role": "system", "content": cfg.data.system_prompt}] if cfg.data.system_prompt else []
    texts = [
        tok.apply_chat_template(system + r["prompt"], tokenize=False, add_generation_prompt=True)
        for r in rows
    ]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    torch.manual_seed(0)
    table = []
    for label, sample, n in (
        ("greedy", False, 1),
        (f"sampled x{samples}, T={cfg.rollout.temperature}", True, samples),
    ):
        with torch.no_grad():
            ids = model.generate(
                **enc,
                max_new_tokens=cfg.rollout.max_new_tokens,
                do_sample=sample,
                temperature=cfg.rollout.temperature if sample else None,
                top_p=None,
                top_k=None,
                num_return_sequences=n,
                pad_token_id=tok.pad_token_id,
            )
        answers = tok.batch_decode(ids[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        truths = [r["reward_model"]["ground_truth"] for r in rows for _ in range(n)]
        scores = [
            gsm8k_score(a, t, strict=True, format_credit=FORMAT_CREDIT) for a, t in zip(answers, truths)
        ]
        exact = sum(s == 1.0 for s in scores) / len(scores)
        fmt = sum(s >= FORMAT_CREDIT for s in scores) / len(scores)
        flexible = sum(gsm8k_score(a, t, strict=False) for a, t in zip(answers, truths)) / len(scores)
        reward = statistics.fmean(scores)
        table.append(f"| {label} | {len(scores)} | {exact:.3f} | {fmt:.3f} | {flexible:.3f} | {reward:.3f} |")
    out.mkdir(parents=True, exist_ok=True)
    lines = [
        "# SmolLM2-135M-Instruct before RL, on the quickstart's validation problems",
        "",
        f"`{command}`",
        "",
        "| decoding | responses | exact (strict) | format (`#### <n>`) | flexible (last number) | reward |",
        "|---|---|---|---|---|---|",
        *table,
    ]
    (out / "pre_rl.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="key=value overrides for every seed's run")
    parser.add_argument("--recipe", type=Path, default=RECIPE)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--name", default="quickstart")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/smollm2_gsm8k")
    parser.add_argument("--runs", type=Path, default=None, help="run directories (default: a temp dir)")
    parser.add_argument("--note", default="", help="a line for the table's file")
    parser.add_argument("--pre-rl", type=int, default=0, help="score the untrained model on N val problems")
    parser.add_argument("--samples", type=int, default=4, help="samples per problem for --pre-rl")
    args = parser.parse_args(argv)
    command = shlex.join(["python", "benchmarks/smollm2_gsm8k_sweep.py", *(argv or sys.argv[1:])])
    if args.pre_rl:
        pre_rl(args.recipe, args.overrides, args.pre_rl, args.samples, args.out, command)
        return 0
    runs = args.runs or Path(tempfile.mkdtemp(prefix="smollm2_gsm8k_"))
    rows = []
    for seed in args.seeds:
        start = time.strftime("%H:%M")
        rows.append(run_seed(args.recipe, seed, args.overrides, runs / f"{args.name}_seed{seed}"))
        r = rows[-1]
        print(
            f"seed {seed} (from {start}): reward {r['reward_first5']:.3f} -> {r['reward_last5']:.3f}, "
            f"exact {r['exact_first5']:.3f} -> {r['exact_last5']:.3f}, training {r['train_s']:.0f} s",
            flush=True,
        )
        write_outputs(args.out, args.name, rows, command, args.note)
    return 0 if all(r["meets_goal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
