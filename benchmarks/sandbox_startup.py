"""Per-call start-up cost of the Python sandbox: wall time of ``print(1)`` through `run_python`,
for several source trees and settings, measured in turns (one call of each per round) so that
every variant sees the same machine load.

    python benchmarks/sandbox_startup.py --calls 30 --before /path/to/other/checkout/src

Each variant runs in its own long-lived worker process (its own `rl3d` from its source tree);
the table gives the median, the quartiles and the range in milliseconds, with the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
WORKER = """
import json, sys, time
from rl3d.tools.python_sandbox import SandboxConfig, run_python
config = SandboxConfig(**json.loads(sys.argv[1]))
for _ in sys.stdin:
    start = time.perf_counter()
    run = run_python("print(1)", config)
    assert run.stdout == "1\\n", run
    print(time.perf_counter() - start, flush=True)
"""


def start_worker(src: str, options: dict) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": src}
    return subprocess.Popen(
        [sys.executable, "-c", WORKER, json.dumps(options)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--before", help="another source tree to compare (its default settings)")
    args = parser.parse_args()
    variants = {}
    if args.before:
        variants["before (its defaults)"] = (args.before, {})
    variants["isolation: kernel"] = (str(SRC), {})
    variants["isolation: kernel, cgroup: off"] = (str(SRC), {"cgroup": "off"})
    variants["isolation: process"] = (str(SRC), {"isolation": "process"})
    workers = {name: start_worker(src, options) for name, (src, options) in variants.items()}
    times: dict[str, list[float]] = {name: [] for name in variants}
    load_before = os.getloadavg()
    for _ in range(args.calls + 1):  # the first round warms caches and is dropped
        for name, worker in workers.items():
            worker.stdin.write("go\n")
            worker.stdin.flush()
            times[name].append(float(worker.stdout.readline()) * 1000)
    load_after = os.getloadavg()
    for worker in workers.values():
        worker.stdin.close()
        worker.wait()
    print(f"{args.calls} calls each, load average {load_before[0]:.1f} before, {load_after[0]:.1f} after\n")
    print("| variant | median ms | quartiles ms | range ms |")
    print("|---|---|---|---|")
    for name, values in times.items():
        values = values[1:]
        q1, _, q3 = statistics.quantiles(values, n=4)
        median = statistics.median(values)
        print(f"| {name} | {median:.0f} | {q1:.0f}-{q3:.0f} | {min(values):.0f}-{max(values):.0f} |")


if __name__ == "__main__":
    main()
