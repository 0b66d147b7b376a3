"""End-of-run outputs: the metrics as CSV, a reward-curve PNG and a one-screen summary (with
the last step's first sample from samples.jsonl)."""

from __future__ import annotations

import csv
import logging
from pathlib import Path

from rl3d.config import RL3DConfig
from rl3d.controller.validation import plot_validation
from rl3d.controller.validation import summary_lines as validation_summary

logger = logging.getLogger(__name__)

# The demo's promise is stated over 20-step windows (docs/demo.md; benchmarks/demo_sweep.py): one step's
# mean reward over 8 prompts x 4 samples is too noisy to judge a run by a few steps.
WINDOW = 20
HEADLINE = (
    "reward/score_mean",
    "response/length_mean",
    "actor/pg_loss",
    "kl/actor_ref_k1",
    "reshard/bytes",
    "reshard/seconds",
    "time/step",
    "perf/tokens_per_s",
    "perf/throughput_tokens_per_s",
    "perf/throughput_tokens_per_s_per_device",
)


def write_summary(cfg: RL3DConfig, history: list[dict[str, float]], run_dir: Path) -> str:
    if not history:
        return ""
    keys = sorted({k for h in history for k in h})
    with open(run_dir / "metrics.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["step", *keys])
        writer.writeheader()
        for i, h in enumerate(history, start=1):
            writer.writerow({"step": i, **h})
    _plot_rewards(
        history,
        run_dir / "reward_curve.png",
        title=f"{cfg.trainer.experiment}: {cfg.algorithm.adv_estimator}",
    )
    rewards = [h["reward/score_mean"] for h in history]
    k = min(WINDOW, len(rewards))
    first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
    lines = [
        f"run {cfg.trainer.experiment}: {len(history)} steps of {cfg.algorithm.adv_estimator} "
        f"on {cfg.model.label}",
        f"mean reward: first {k} steps {first:.3f} -> last {k} steps {last:.3f} ({last - first:+.3f})",
        *_kl_line(history[-k:]),
        *validation_summary(run_dir),
        *(f"  {key:<22} {history[-1][key]:.6g}" for key in HEADLINE if key in history[-1]),
        *sample_lines(run_dir),
        f"total time {sum(h.get('time/step', 0.0) for h in history):.1f} s; outputs in {run_dir}: "
        "metrics.jsonl, samples.jsonl, metrics.csv, reward_curve.png, resolved_config.yaml",
    ]
    text = "\n".join(lines)
    (run_dir / "summary.txt").write_text(text + "\n")
    logger.info("summary\n%s", text)
    return text


def sample_lines(run_dir: Path, width: int = 200) -> list[str]:
    """The last training sample of samples.jsonl: the prompt's end (the question and the
    generation prompt) and the response's start, one line each, newlines shown as \\n."""
    from rl3d.logging.samples import last_sample

    record = last_sample(run_dir)
    if record is None:
        return []
    prompt = record["prompt"].replace("\n", "\\n")
    response = record["response"].replace("\n", "\\n")
    prompt = prompt if len(prompt) <= width else "..." + prompt[-width:]
    response = response if len(response) <= width else response[:width] + "..."
    return [
        f"a sample (step {record['step']}, reward {record['reward']:.4g}, {record['finish_reason']}, "
        f"{record['num_tokens']} tokens):",
        f"  prompt:   {prompt}",
        f"  response: {response}",
    ]


def _kl_line(rows: list[dict[str, float]]) -> list[str]:
    kls = [h["kl/actor_ref_k1"] for h in rows if "kl/actor_ref_k1" in h]
    if not kls:  # no reference (KL coefficient 0)
        return []
    return [f"actor-reference KL (k1): mean of the last {len(kls)} steps {sum(kls) / len(kls):.3f}"]


def _plot_rewards(history: list[dict[str, float]], path: Path, *, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = list(range(1, len(history) + 1))
    mean = [h["reward/score_mean"] for h in history]
    std = [h.get("reward/score_std", 0.0) for h in history]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, mean, marker="o", label="mean reward")
    ax.fill_between(steps, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)], alpha=0.2)
    plot_validation(ax, path.parent)  # trainer.val_every's curve, when the run validated
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
