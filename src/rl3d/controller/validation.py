"""Validation during training: the actor answers held-out prompts, the reward scores them.

`trainer.val_every` steps (and after the last step; with `trainer.val_before_train`, also
before the first) the controller generates for every validation prompt once greedily and
`val_n` times sampled (the rollout's temperature, top-p, top-k), scores every response with the
reward group, and logs with that step's metrics:

- `val/score_greedy`, `val/score_sampled`: mean scores (with a learned reward model also the
  rule's, `val/rule_score_*`, and with a cost `val/cost_*`);
- `val/pass_at_{k}` for each k of `trainer.val_pass_k`: the unbiased pass@k (Chen et al. 2021,
  "Evaluating Large Language Models Trained on Code") from the n samples of each prompt, a
  sample passing when its score >= `trainer.val_pass_threshold`, averaged over prompts. The
  score is the rule reward's (`reward.fn`): with a learned reward model, `rule_score`;
- `val/response_length_greedy`, `val/response_length_sampled`; `time/validation`;
- with a separate rollout pool (`rollout.placement: separate`), `val/policy_version`: the
  policy version that generated the answers. The controller's generation calls are then
  requests to that pool, made after the step's weights were sent: validation after step k
  answers with version k (the actor after k updates), the policy a colocated run validates.

Validation leaves training exactly as it would have been without it: it only calls worker-group
methods that keep no state between calls (the engine samples from per-sample generators
seeded by the call's `step`; validation passes steps from `VAL_STEP_BASE` up, which no
training call uses), the controller's global RNG streams are put back afterwards, and the
prompts go out in chunks of `data.prompts_per_step` so the rollout engine's buffers never grow
beyond a training step's. The same seeds serve every validation, so the curve compares policies
on the same random draws.

The validation prompts are `data.val_files` (parquet, read like `data.train_files`), or, for
synthetic data, prompts of the same task drawn from another seed that are not among the
training prompts. The repeat tasks have only as many distinct prompts as symbols, all of them
in training: their split is every distinct prompt, which then is not held out (logged).
"""

from __future__ import annotations

import csv
import dataclasses
import logging
import math
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from rl3d.config import RL3DConfig
from rl3d.config.validation import SYNTHETIC_VAL_PROMPTS, validation_samples
from rl3d.controller.rows import one_row_per_sample

logger = logging.getLogger(__name__)

VAL_STEP_BASE = 1 << 30  # generate_sequences' `step` (its seed) in validation; training's are far below
VAL_CSV = "validation.csv"  # every validation of the run (step 0 too), for the curve
SCORE_KEYS = ("score", "rule_score", "cost", "rule_cost")  # logged as val/<key>_greedy|_sampled
_SYNTHETIC_VAL_SEED = 7_919  # added to data.synthetic.seed for the split's candidate prompts


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from `n` samples of which `c` pass: 1 - C(n - c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k: need 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def mean_pass_at_k(scores_by_prompt: dict[Any, list[float]], k: int, threshold: float) -> float:
    values = [pass_at_k(len(s), sum(x >= threshold for x in s), k) for s in scores_by_prompt.values()]
    return sum(values) / len(values)


def validation_prompts(cfg: RL3DConfig, tokenizer, train_items) -> list:
    """The `PromptItem`s validation answers (see the module docstring)."""
    from rl3d.data import load_prompt_dataset
    from rl3d.rewards import answer_check_for

    limit = cfg.trainer.val_num_prompts
    if cfg.data.val_files:
        data = dataclasses.replace(cfg.data, train_files=list(cfg.data.val_files))
        items = list(load_prompt_dataset(data, tokenizer, answer_check=answer_check_for(cfg.reward, data)))
        return items[:limit] if limit else items
    return synthetic_split(cfg, tokenizer, [item.prompt_ids for item in train_items])


def synthetic_split(cfg: RL3DConfig, tokenizer, train_prompts: list[list[int]]) -> list:
    from rl3d.data.dataset import PromptItem
    from rl3d.data.synthetic import get_synthetic_task

    syn = cfg.data.synthetic
    task = get_synthetic_task(syn.task)
    wanted = cfg.trainer.val_num_prompts or SYNTHETIC_VAL_PROMPTS
    seen = {tuple(p) for p in train_prompts}
    prompts: list[list[int]] = []
    for ids in task.make_prompts(20 * wanted, syn.seed + _SYNTHETIC_VAL_SEED):
        if tuple(ids) not in seen and len(prompts) < wanted:
            seen.add(tuple(ids))
            prompts.append(ids)
    if not prompts:  # every prompt the task has is a training prompt (the repeat tasks)
        prompts = [list(p) for p in dict.fromkeys(tuple(p) for p in train_prompts)][:wanted]
        logger.info(
            "validation: synthetic task %s has no prompt outside training; validating on its %d "
            "distinct prompts (not held out)",
            task.name,
            len(prompts),
        )
    return [
        PromptItem(i, ids, tokenizer.decode(ids), task.answer(ids), f"synthetic-val:{task.name}:{i}")
        for i, ids in enumerate(prompts)
    ]


class Validator:
    """Runs validation when due; `after(step)` returns the `val/*` metrics to log with the step."""

    def __init__(
        self,
        cfg: RL3DConfig,
        rollout,
        score,
        prompts: list,
        *,
        sinks: list,
        run_dir: Path,
        writes: bool,
        samples=None,
    ):
        """`rollout(prompts, step=, greedy=) -> batch`: the trainer's generation call
        (`RLTrainer.rollout`: the actor's ranks, or the separate rollout pool);
        `score(batch, metrics) -> batch`: the trainer's scoring (the reward group, then any
        learned reward or cost model); `samples`: the run's `SamplesLog`, which gets the first
        greedy answers (`split: val`)."""
        assert prompts, "validation needs prompts"
        self.cfg, self.rollout, self.score, self.prompts = cfg, rollout, score, prompts
        self.sinks, self.run_dir, self.writes, self.samples = sinks, Path(run_dir), writes, samples
        self.num_samples = validation_samples(cfg)

    def start(self, start_step: int) -> None:
        """Before the first step of a fresh run: validate the starting policy (step 0)."""
        if self.cfg.trainer.val_before_train and start_step == 0:
            metrics = self.run(0)
            for sink in self.sinks:
                sink.log(0, metrics)

    def due(self, step: int) -> bool:
        """Whether `after(step)` validates."""
        every, last = self.cfg.trainer.val_every, self.cfg.trainer.total_steps
        return every > 0 and (step % every == 0 or step == last)

    def after(self, step: int) -> dict[str, float]:
        return self.run(step) if self.due(step) else {}

    def run(self, step: int) -> dict[str, float]:
        from rl3d.checkpoint.rng import capture_rng_state, restore_rng_state

        started, rng = time.perf_counter(), capture_rng_state()
        try:
            greedy = self._generate(step, greedy=True, repeats=1)
            sampled = self._generate(step, greedy=False, repeats=self.num_samples // self.cfg.rollout.n)
        finally:
            restore_rng_state(rng)
        metrics: dict[str, float] = {}
        for key in SCORE_KEYS:  # the reward; with a learned model also the rule's score; a cost
            if key in greedy:
                metrics[f"val/{key}_greedy"] = _mean(greedy[key])
                metrics[f"val/{key}_sampled"] = _mean(sampled[key])
        metrics["val/response_length_greedy"] = _mean(greedy["length"])
        metrics["val/response_length_sampled"] = _mean(sampled["length"])
        versions = greedy["policy_version"] + sampled["policy_version"]
        if versions:  # a separate rollout pool's answers carry the version that made them
            metrics["val/policy_version"] = float(max(versions))
        tr = self.cfg.trainer
        for k in tr.val_pass_k:
            metrics[f"val/pass_at_{k}"] = mean_pass_at_k(sampled["by_prompt"], k, tr.val_pass_threshold)
        metrics["time/validation"] = time.perf_counter() - started
        if self.writes:
            logger.info(
                "validation at step %d (%d prompts): %s",
                step,
                len(self.prompts),
                ", ".join(f"{k} {v:.4g}" for k, v in metrics.items()),
            )
            self._append_csv(step, metrics)
        return metrics

    def _generate(self, step: int, *, greedy: bool, repeats: int) -> dict[str, Any]:
        """Scores and response lengths of every response; sampled ones grouped by prompt."""
        from rl3d.controller.prompts import prompt_batch
        from rl3d.workers.rollout_worker import POLICY_VERSION

        chunk = self.cfg.data.prompts_per_step
        out: dict[str, Any] = defaultdict(list)
        by_prompt: dict[int, list[float]] = defaultdict(list)
        call = 0 if greedy else 1 << 20  # greedy and sampled calls never share a seed
        for _ in range(repeats):
            for lo in range(0, len(self.prompts), chunk):
                items = self.prompts[lo : lo + chunk]
                prompts = prompt_batch(items)
                prompts.set("uid", [item.index for item in items])
                seed_step = VAL_STEP_BASE + call
                batch = self.rollout(prompts, step=seed_step, greedy=greedy)
                call += 1
                batch = one_row_per_sample(self.score(batch, {}))  # an agent's extra rows: once
                if greedy and lo == 0 and self.samples is not None:
                    self.samples.log(step, batch, split="val")
                for key in SCORE_KEYS:
                    if key in batch:
                        out[key] += batch[key].tolist()
                out["length"] += batch["response_mask"].sum(-1).tolist()
                if POLICY_VERSION in batch:
                    out["policy_version"] += batch[POLICY_VERSION][batch["response_mask"].bool()].tolist()
                passed_on = batch["rule_score"] if "rule_score" in batch else batch["score"]
                for index, score in zip(batch["index"], passed_on.tolist(), strict=True):
                    by_prompt[int(index)].append(score)
        out["by_prompt"] = by_prompt
        return out

    def _append_csv(self, step: int, metrics: dict[str, float]) -> None:
        path = self.run_dir / VAL_CSV
        fields = ["step", *sorted(metrics)]
        new = not path.is_file()
        with open(path, "a", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=fields)
            if new:
                writer.writeheader()
            writer.writerow({"step": step, **metrics})


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def read_validation_csv(run_dir: Path) -> list[dict[str, float]]:
    """The rows of `run_dir/validation.csv` (none when the run did not validate)."""
    path = Path(run_dir) / VAL_CSV
    if not path.is_file():
        return []
    with open(path, newline="") as f:
        return [{k: float(v) for k, v in row.items() if v not in ("", None)} for row in csv.DictReader(f)]


def plot_validation(ax, run_dir: Path) -> None:
    """The validation curve (greedy and sampled mean score by step) on the reward plot's axes."""
    rows = read_validation_csv(run_dir)
    for kind, marker in (("greedy", "s"), ("sampled", "^")):
        points = [(r["step"], r[f"val/score_{kind}"]) for r in rows if f"val/score_{kind}" in r]
        if points:
            ax.plot(*zip(*points), marker=marker, linestyle="--", label=f"validation ({kind})")


def summary_lines(run_dir: Path) -> list[str]:
    rows = read_validation_csv(run_dir)
    if not rows:
        return []
    first, last = rows[0], rows[-1]
    passes = [f"{k.removeprefix('val/')} {v:.3f}" for k, v in last.items() if k.startswith("val/pass_at_")]
    return [
        f"validation: greedy score {first['val/score_greedy']:.3f} (step {first['step']:.0f}) -> "
        f"{last['val/score_greedy']:.3f} (step {last['step']:.0f}); "
        + "; ".join([f"sampled {last['val/score_sampled']:.3f}", *passes])
    ]
