"""The demo's fixed costs per step, by stage: where a step of the tiny GRPO demo goes.

`measure` trains the demo (`recipes/quickstart_cpu_grpo.yaml`, 2 gloo ranks) with this module
as a `trainer.hooks.on_step_end` hook, once per checkout given (`--tree LABEL=DIR`: DIR's `src`
and recipe; trees alternate, so the trees compared share the machine's load), and appends each
run's per-step, per-rank records to `OUT/<label>.jsonl`. On the ranks the hook wraps the
controller's stage timer and `torch.distributed`'s collectives; per stage it records:
- wall and process-CPU seconds (the controller's own stage timer; CPU: the slower rank's);
- collective calls and their seconds (call to completion, an async one's `wait` included);
- on the last `--profile` steps only, under the torch profiler: the aten ops dispatched (every
  op, nested ones too) and the seconds spent in top-level ops outside collectives.
The first `--warmup` steps are dropped; the rest (`--steps`, unprofiled) give the medians.
What is left of a stage's wall time after its collectives and its ops ("python") is the
Python and framework time between ops: median unprofiled wall - median unprofiled collective
seconds - median profiled op seconds (the profiler slows the code between ops, hardly the ops).
Collective seconds include waiting for the other rank, so they grow with the machine's load.

`report` reads those records into `OUT/overhead.csv` (per tree and stage: medians over steps and
runs; wall and CPU of the slower rank, the rest rank 0's), `OUT/overhead.md` (the table with the command and
the load) and `OUT/overhead.png` (stacked per-stage time by kind, per tree).

    python benchmarks/demo_overhead.py measure --tree before=/tmp/base --tree after=. \\
        --out benchmarks/demo_overhead --repeats 2
    python benchmarks/demo_overhead.py report benchmarks/demo_overhead
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = Path("recipes/quickstart_cpu_grpo.yaml")
OUT_ENV, PROFILE_ENV = "RL3D_DEMO_OVERHEAD_OUT", "RL3D_DEMO_OVERHEAD_PROFILE"  # PROFILE: "first,last" step
STAGES = ("generate", "old_logp", "ref_logp", "advantage", "update_actor", "reshard")
COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "broadcast",
    "send",
    "recv",
    "batch_isend_irecv",
    "all_gather_object",
    "broadcast_object_list",
    "barrier",
    "all_to_all_single",
    "reduce",
    "gather",
    "scatter",
)  # fmt: skip  (isend, irecv: P2POp checks them by identity)
KINDS = ("collective", "ops", "python")

# -- on the ranks: the hook ------------------------------------------------------------------


class _Recorder:
    """Per-stage collective counts and seconds of the step in progress (ranks only)."""

    def __init__(self):
        self.stage = "other"
        self.depth = 0  # an object collective calls tensor collectives: count the outer one
        self.calls: dict[str, int] = defaultdict(int)
        self.seconds: dict[str, float] = defaultdict(float)
        self.profiler = None
        self.profiled_step = False
        self.timer = None  # the step's StageTimer: its process-CPU seconds

    def reset(self) -> None:
        self.calls.clear()
        self.seconds.clear()


REC = _Recorder()


class _TimedWork:
    """An async collective's handle whose `wait` adds to the stage it was issued in."""

    def __init__(self, work, stage: str):
        self._work, self._stage = work, stage

    def wait(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self._work.wait(*args, **kwargs)
        finally:
            REC.seconds[self._stage] += time.perf_counter() - start

    def __getattr__(self, name):
        return getattr(self._work, name)


def _timed_collective(name: str, fn):
    from torch.profiler import record_function

    def wrapper(*args, **kwargs):
        if REC.depth:
            return fn(*args, **kwargs)
        stage = REC.stage
        REC.depth += 1
        start = time.perf_counter()
        try:
            with record_function(f"collective:{name}"):
                out = fn(*args, **kwargs)
        finally:
            REC.depth -= 1
            REC.calls[stage] += 1
            REC.seconds[stage] += time.perf_counter() - start
        return _TimedWork(out, stage) if kwargs.get("async_op") and out is not None else out

    return wrapper


def _install() -> None:
    import torch.distributed as dist
    from torch.profiler import record_function

    from rl3d.controller import trainer

    for name in COLLECTIVES:
        if hasattr(dist, name):
            setattr(dist, name, _timed_collective(name, getattr(dist, name)))
    timer_call = trainer.StageTimer.__call__

    @contextlib.contextmanager
    def staged(self, stage):
        REC.stage, REC.timer = stage, self
        try:
            with timer_call(self, stage), record_function(f"stage:{stage}"):
                yield
        finally:
            REC.stage = "other"

    trainer.StageTimer.__call__ = staged


def _profile_counts(profiler) -> dict[str, dict[str, float]]:
    """Per stage: aten ops dispatched (nested included) and seconds in top-level ops outside
    collectives, from the profiler's events."""
    ops: dict[str, dict[str, float]] = defaultdict(lambda: {"ops": 0, "op_s": 0.0})
    for event in profiler.events():
        if not event.name.startswith("aten::"):
            continue
        parent, top, stage = event.cpu_parent, True, None
        while parent is not None:
            if parent.name.startswith("collective:"):
                stage = None
                break
            if parent.name.startswith("aten::"):
                top = False
            if parent.name.startswith("stage:"):
                stage = parent.name.split(":", 1)[1]
                break
            parent = parent.cpu_parent
        if stage is None:
            continue
        ops[stage]["ops"] += 1
        if top:
            ops[stage]["op_s"] += (event.time_range.end - event.time_range.start) / 1e6
    return dict(ops)


def on_step_end(step, batch, metrics):
    """The hook: this step's record (wall, CPU, collectives; ops when profiled) to
    `$RL3D_DEMO_OVERHEAD_OUT/rank<R>.jsonl`; starts the profiler for the steps it covers."""
    rank = int(os.environ.get("RANK", "0"))
    row = {"step": step, "rank": rank, "profiled": REC.profiled_step, "stages": {}}
    ops = {}
    if REC.profiler is not None:
        REC.profiler.__exit__(None, None, None)
        ops, REC.profiler = _profile_counts(REC.profiler), None
    for stage in STAGES:
        if f"time/{stage}" in metrics:
            row["stages"][stage] = {
                "wall_s": metrics[f"time/{stage}"],
                "cpu_s": REC.timer.cpu_seconds.get(stage, 0.0),
                "coll_n": REC.calls.get(stage, 0),
                "coll_s": REC.seconds.get(stage, 0.0),
                **ops.get(stage, {}),
            }
    REC.reset()
    with open(Path(os.environ[OUT_ENV]) / f"rank{rank}.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
    first, last = (int(s) for s in os.environ[PROFILE_ENV].split(","))
    REC.profiled_step = first <= step + 1 <= last
    if REC.profiled_step:
        from torch.profiler import ProfilerActivity, profile

        REC.profiler = profile(activities=[ProfilerActivity.CPU])
        REC.profiler.__enter__()
    return None


if os.environ.get(OUT_ENV):  # imported by a rank as its hook
    _install()

# -- on the host: measure and report ---------------------------------------------------------


def measure_once(tree: Path, out: Path, label: str, args, overrides: list[str]) -> Path:
    """One `rl3d train` of `tree`'s recipe with its `src` first on the path; the ranks' records
    appended to `out/<label>.jsonl` as one line."""
    work = out / f"_{label}"
    work.mkdir(parents=True, exist_ok=True)
    for old in work.glob("rank*.jsonl"):
        old.unlink()
    total = args.warmup + args.steps + args.profile
    env = dict(os.environ)
    paths = [str((tree / "src").resolve()), str(ROOT / "benchmarks"), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env[OUT_ENV], env[PROFILE_ENV] = str(work.resolve()), f"{args.warmup + args.steps + 1},{total}"
    recipe = (tree / args.recipe).resolve()
    cmd = [sys.executable, "-m", "rl3d.cli", "train", str(recipe), f"trainer.run_dir={work / 'run'}"]
    cmd += [f"trainer.total_steps={total}", "checkpoint.save_every=0"]
    cmd += ["trainer.hooks.on_step_end=demo_overhead:on_step_end", *overrides, "--overwrite"]
    load = os.getloadavg()[0]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{shlex.join(cmd)} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for p in sorted(work.glob("rank*.jsonl")) for line in p.read_text().splitlines()]
    meta = {"label": label, "tree": str(tree), "load_before": load, "load_after": os.getloadavg()[0]}
    meta |= {"warmup": args.warmup, "cmd": shlex.join(cmd)}
    target = out / f"{label}.jsonl"
    with open(target, "a") as f:
        f.write(json.dumps({"meta": meta, "rows": rows}) + "\n")
    return target


def summarize(runs: list[dict]) -> list[dict]:
    """Per stage (and the whole step): medians over the kept steps of every run given."""
    walls, cpus, colls, coll_s, ops, op_s = (defaultdict(list) for _ in range(6))
    for run in runs:
        warmup = run["meta"]["warmup"]
        by_step = defaultdict(dict)
        for row in run["rows"]:
            if row["step"] > warmup:
                by_step[row["step"]][row["rank"]] = row
        for ranks in by_step.values():
            first = ranks[min(ranks)]
            for stage, rec in first["stages"].items():
                if first["profiled"]:
                    ops[stage].append(rec.get("ops", 0))
                    op_s[stage].append(rec.get("op_s", 0.0))
                    continue
                walls[stage].append(max(r["stages"][stage]["wall_s"] for r in ranks.values()))
                cpus[stage].append(max(r["stages"][stage]["cpu_s"] for r in ranks.values()))
                colls[stage].append(rec["coll_n"])
                coll_s[stage].append(rec["coll_s"])
    rows = []
    for stage in [s for s in STAGES if s in walls]:
        series = {"wall": walls, "cpu": cpus, "coll_n": colls, "coll_s": coll_s, "ops": ops, "op_s": op_s}
        med = {k: statistics.median(v[stage]) if v[stage] else 0.0 for k, v in series.items()}
        med["python_s"] = max(med["wall"] - med["coll_s"] - med["op_s"], 0.0)
        rows.append({"stage": stage, **med})
    total = {
        k: sum(r[k] for r in rows) for k in ("wall", "cpu", "coll_n", "coll_s", "ops", "op_s", "python_s")
    }
    return rows + [{"stage": "step", **total}]


def report(out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trees = {}
    order = out / "trees.txt"  # the measured order (else by name)
    labels = order.read_text().split() if order.exists() else sorted(p.stem for p in out.glob("*.jsonl"))
    for path in [out / f"{label}.jsonl" for label in labels]:
        runs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        trees[path.stem] = (runs, summarize(runs))
    header = [
        "tree",
        "stage",
        "wall_ms",
        "cpu_ms",
        "collectives",
        "collective_ms",
        "aten_ops",
        "op_ms",
        "python_ms",
    ]
    table = []
    for label, (_, rows) in trees.items():
        for r in rows:
            ms = [r[k] * 1e3 for k in ("wall", "cpu")] + [r["coll_n"], r["coll_s"] * 1e3, r["ops"]]
            table.append([label, r["stage"], *ms, r["op_s"] * 1e3, r["python_s"] * 1e3])
    with open(out / "overhead.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows([[c if isinstance(c, str) else round(c, 3) for c in row] for row in table])
    loads = [
        f"{label}: load {min(r['meta']['load_before'] for r in runs):.1f}-"
        f"{max(r['meta']['load_after'] for r in runs):.1f}, {len(runs)} run(s)"
        for label, (runs, _) in trees.items()
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(c if isinstance(c, str) else f"{c:.1f}" for c in row) + " |" for row in table]
    first = next(iter(trees.values()))[0][0]["meta"]
    lines += ["", "load (1-min average, before/after each run): " + "; ".join(loads), "", f"`{first['cmd']}`"]
    (out / "overhead.md").write_text("\n".join(lines) + "\n")
    fig, axes = plt.subplots(1, len(trees), figsize=(5 * len(trees), 4), sharey=True, squeeze=False)
    for ax, (label, (_, rows)) in zip(axes[0], trees.items()):
        stages = [r for r in rows if r["stage"] != "step"]
        bottom = [0.0] * len(stages)
        for kind, key in zip(KINDS, ("coll_s", "op_s", "python_s")):
            # the profiled op seconds, capped at what the unprofiled wall leaves (a noisy machine)
            cap = [r["wall"] - r["coll_s"] if key == "op_s" else r[key] for r in stages]
            heights = [min(r[key], c) * 1e3 for r, c in zip(stages, cap)]
            ax.bar([r["stage"] for r in stages], heights, bottom=bottom, label=kind)
            bottom = [b + h for b, h in zip(bottom, heights)]
        step = rows[-1]
        ms, n, ops = step["wall"] * 1e3, step["coll_n"], step["ops"]
        ax.set_title(f"{label}: step {ms:.0f} ms, {n:.0f} collectives, {ops:.0f} ops")
        ax.tick_params(axis="x", rotation=30)
    axes[0][0].set_ylabel("ms per step (median)")
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(out / "overhead.png", dpi=110)
    print("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="mode", required=True)
    m = sub.add_parser("measure", help="train the demo per tree; records into OUT")
    m.add_argument("--tree", action="append", required=True, metavar="LABEL=DIR", help="a checkout's root")
    m.add_argument("--out", type=Path, required=True)
    m.add_argument("--recipe", type=Path, default=RECIPE, help="relative to each tree")
    m.add_argument("--warmup", type=int, default=5)
    m.add_argument("--steps", type=int, default=20, help="timed steps per run (unprofiled)")
    m.add_argument("--profile", type=int, default=3, help="profiled steps per run, after the timed ones")
    m.add_argument("--repeats", type=int, default=1, help="runs per tree, trees alternating")
    m.add_argument("overrides", nargs="*", help="recipe overrides for every run")
    r = sub.add_parser("report", help="CSV, table and PNG from OUT's records")
    r.add_argument("out", type=Path)
    args = ap.parse_args(argv)
    if args.mode == "report":
        report(args.out)
        return 0
    trees = [tuple(s.split("=", 1)) for s in args.tree]
    args.out.mkdir(parents=True, exist_ok=True)
    for label, _ in trees:
        (args.out / f"{label}.jsonl").unlink(missing_ok=True)
    (args.out / "trees.txt").write_text("\n".join(label for label, _ in trees) + "\n")
    for i in range(args.repeats):
        for label, tree in trees:
            measure_once(Path(tree), args.out, label, args, args.overrides)
            print(f"{label} run {i + 1}/{args.repeats} done", flush=True)
    report(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
