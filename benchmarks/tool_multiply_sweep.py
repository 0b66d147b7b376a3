"""The tool demo over several seeds: SFT warm start, then GRPO (recipes/quickstart_cpu_tool_grpo.yaml).

Per seed it runs, one at a time (each takes both CPU cores):
- the SFT-only baseline: the recipe's warm start, then 20 rollout steps whose updates do
  nothing (`actor.optim.lr=1e-12`): what the warmed policy does before RL;
- the recipe: warm start, then `trainer.total_steps` GRPO steps;
and writes into `--out`, as `<name>.csv` / `.md` / `.png`: per seed, the SFT's first and last
loss, the baseline's means, and the first-20 / last-20 step means of the reward and of the
recipe's behaviour metrics (`rl3d.rewards.tool_task:tool_multiply_metrics`: valid first call,
exact operands, exact answer = the tool's result copied), entropy, and the times.

    python benchmarks/tool_multiply_sweep.py --seeds 1 2 3
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from demo_sweep import spread, train_run, write_seed_csv  # noqa: E402 - shared with the demo sweep

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes/quickstart_cpu_tool_grpo.yaml"
WINDOW = 20
KEYS = {
    "reward": "reward/score_mean",
    "valid": "tool_task/call_valid",
    "operands": "tool_task/operands_exact",
    "answer": "tool_task/answer_exact",
    "entropy": "actor/entropy",
}
COLUMNS = (
    "seed",
    "sft_loss_first",
    "sft_loss_last",
    *(f"sft_only_{k}" for k in ("reward", "operands", "answer")),
    *(f"{w}_{k}" for w in ("first20", "last20") for k in KEYS),
    "sft_s",
    "train_s",
    "wall_s",
)


def train(recipe: Path, run_dir: Path, overrides: list[str]) -> tuple[list[dict], list[dict], float]:
    rows, wall = train_run(recipe, run_dir, overrides)
    sft = [json.loads(line) for line in (run_dir / "warm_start.jsonl").read_text().splitlines() if line]
    return rows, sft, wall


def mean(rows: list[dict], key: str) -> float:
    return statistics.fmean(r.get(key, float("nan")) for r in rows)


def run_seed(recipe: Path, seed: int, overrides: list[str], runs: Path) -> dict:
    base = [f"trainer.seed={seed}", *overrides]
    only, _, _ = train(
        recipe, runs / f"sft_only_{seed}", [*base, "trainer.total_steps=20", "actor.optim.lr=1e-12"]
    )
    rows, sft, wall = train(recipe, runs / f"seed_{seed}", base)
    out = {
        "seed": seed,
        "sft_loss_first": sft[0]["warm_start/loss"],
        "sft_loss_last": sft[-1]["warm_start/loss"],
        "sft_only_reward": mean(only, KEYS["reward"]),
        "sft_only_operands": mean(only, KEYS["operands"]),
        "sft_only_answer": mean(only, KEYS["answer"]),
        "sft_s": sft[-1]["warm_start/seconds"],
        "train_s": sum(r.get("time/step", 0.0) for r in rows),
        "wall_s": wall,
    }
    for window, part in (("first20", rows[:WINDOW]), ("last20", rows[-WINDOW:])):
        out |= {f"{window}_{k}": mean(part, key) for k, key in KEYS.items()}
    out["curves"] = {k: [r.get(key, float("nan")) for r in rows] for k, key in KEYS.items()}
    print(
        f"seed {seed}: SFT-only exact answers {out['sft_only_answer']:.3f}; exact answers "
        f"{arrow(out, 'answer')}, reward {arrow(out, 'reward')} (first-20 -> last-20 steps; "
        f"{out['train_s']:.0f} s training, {wall:.0f} s wall)",
        flush=True,
    )
    return out


def arrow(row: dict, key: str) -> str:
    return f"{row[f'first20_{key}']:.3f} -> {row[f'last20_{key}']:.3f}"


def write_outputs(out: Path, name: str, rows: list[dict], command: str, note: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_seed_csv(out / f"{name}.csv", COLUMNS, rows)
    lines = [f"# tool demo sweep `{name}`", "", f"`{command}`", ""]
    lines += [
        "| seed | SFT loss first -> last | SFT-only exact answer | exact answer first-20 -> last-20 | "
        "exact operands first-20 -> last-20 | reward first-20 -> last-20 | SFT s | RL training s | wall s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = [
            r["seed"],
            f"{r['sft_loss_first']:.2f} -> {r['sft_loss_last']:.3f}",
            f"{r['sft_only_answer']:.3f}",
            arrow(r, "answer"),
            arrow(r, "operands"),
            arrow(r, "reward"),
            f"{r['sft_s']:.0f}",
            f"{r['train_s']:.0f}",
            f"{r['wall_s']:.0f}",
        ]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    cells = [
        "min / mean / max",
        "",
        spread(rows, "sft_only_answer"),
        f"{spread(rows, 'first20_answer')} -> {spread(rows, 'last20_answer')}",
        f"{spread(rows, 'first20_operands')} -> {spread(rows, 'last20_operands')}",
        f"{spread(rows, 'first20_reward')} -> {spread(rows, 'last20_reward')}",
        spread(rows, "sft_s"),
        spread(rows, "train_s"),
        spread(rows, "wall_s"),
    ]
    lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "SFT-only: the warmed policy over 20 rollout steps without updates (lr 1e-12)."]
    if note:
        lines += ["", note]
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    _plot(out / f"{name}.png", name, rows)


def _plot(path: Path, name: str, rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for r in rows:
        for ax, key in zip(axes, ("answer", "reward")):
            ax.plot(range(1, len(r["curves"][key]) + 1), r["curves"][key], label=f"seed {r['seed']}", lw=1)
    for r in rows:
        axes[0].axhline(r["sft_only_answer"], ls=":", lw=0.8, color="grey")
    axes[0].set_title("exact answers (tool result copied); dotted: SFT only")
    axes[1].set_title("reward")
    for ax in axes:
        ax.set_xlabel("RL step")
        ax.legend()
    fig.suptitle(name)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("overrides", nargs="*", help="key=value overrides for every run")
    parser.add_argument("--recipe", type=Path, default=RECIPE)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--name", default="tool_multiply")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/demo")
    parser.add_argument("--runs", type=Path, default=None, help="run directories (default: a temp dir)")
    parser.add_argument("--note", default="", help="a line for the table's file (the machine, its load)")
    args = parser.parse_args(argv)
    command = shlex.join(["python", "benchmarks/tool_multiply_sweep.py", *sys.argv[1:]])
    with tempfile.TemporaryDirectory() as tmp:
        runs = args.runs or Path(tmp)
        rows = [run_seed(args.recipe, s, args.overrides, runs) for s in args.seeds]
    write_outputs(args.out, args.name, rows, command, args.note)
    print((args.out / f"{args.name}.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
