"""What a device_check stage left behind, as the report's `metrics` (standard library only).

By the file's kind: pytest's JUnit XML becomes counts and the names of failed and skipped tests
with their messages; a run's metrics.jsonl becomes per-step medians (the first step, a warm-up,
left out) and the rollout-vs-trainer log-prob gap; any other JSON is taken as it is.
"""

from __future__ import annotations

import json
import statistics
import xml.etree.ElementTree as ET
from pathlib import Path

# metrics.jsonl keys summarised by their median over the steps after the first
MEDIAN_KEYS = (
    "time/step",
    "time/generate",
    "time/update_actor",
    "time/reshard",
    "perf/tokens_per_s",
    "perf/gen_tokens_per_s",
    "perf/throughput_tokens_per_s",
)


def junit_summary(path: Path) -> dict:
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failed, skipped = [], []
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        for kind, into in (("failure", failed), ("error", failed), ("skipped", skipped)):
            for node in case.findall(kind):
                into.append({"test": name, "message": (node.get("message") or "")[:300]})
    return counts | {"failed": failed, "skipped_tests": skipped}


def run_summary(path: Path) -> dict:
    """A training run's metrics.jsonl: steps done, medians after the warm-up step, the log-prob
    gap between the rollout engine and the trainer (max over steps; mean of the step means)."""
    steps = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    out: dict = {"steps": len(steps)}
    if not steps:
        return out
    timed = steps[1:] or steps
    for key in MEDIAN_KEYS:
        values = [s[key] for s in timed if key in s]
        if values:
            out[f"median {key}"] = statistics.median(values)
    gaps_max = [s["rollout/logp_diff_max"] for s in steps if "rollout/logp_diff_max" in s]
    gaps_mean = [s["rollout/logp_diff_mean"] for s in steps if "rollout/logp_diff_mean" in s]
    if gaps_max:
        out["rollout/logp_diff_max (max over steps)"] = max(gaps_max)
        out["rollout/logp_diff_mean (mean over steps)"] = statistics.fmean(gaps_mean)
    rewards = [s["reward/score_mean"] for s in steps if "reward/score_mean" in s]
    if rewards:
        out["reward/score_mean first, last"] = [rewards[0], rewards[-1]]
    return out


def collect(work: Path, reads: tuple[tuple[str, str], ...]) -> dict:
    """{key: summary of work/path} for each of `reads` that exists; a file that cannot be read
    says why instead of failing the report."""
    metrics: dict = {}
    for key, relative in reads:
        path = work / relative
        if not path.is_file():
            continue
        try:
            if path.suffix == ".xml":
                metrics[key] = junit_summary(path)
            elif path.suffix == ".jsonl":
                metrics[key] = run_summary(path)
            else:
                metrics[key] = json.loads(path.read_text())
        except (OSError, ValueError, ET.ParseError) as err:
            metrics[key] = {"unreadable": f"{relative}: {type(err).__name__}: {err}"}
    return metrics
