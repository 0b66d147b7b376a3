"""benchmarks/netns_transition.py: the measured transition benchmark with its ranks on two
simulated nodes behind a tbf-shaped link: the bytes the busiest node sends match the plan, and
the measured time is bounded below by those bytes at the link's rate (the link is real)."""

import csv
import subprocess
import sys

import pytest
from train_helpers import ROOT

from rl3d.testing.netns import netns_unavailable_reason

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.distributed]


def test_shaped_link_bounds_the_measured_transition(tmp_path):
    reason = netns_unavailable_reason()
    if reason:
        pytest.skip(f"no simulated nodes: {reason}")
    out = tmp_path / "bench"
    cmd = [sys.executable, str(ROOT / "benchmarks/netns_transition.py"), "--nodes", "2", "--link-gbit", "0.1"]
    cmd += ["--strategies", "hybridflow", "--repeats", "2", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [row] = list(csv.DictReader(open(out / "transition.csv")))
    assert row["strategy"] == "hybridflow" and row["links_match_plan"] == "True"
    assert int(row["node_out_bytes_max"]) > 1_000_000  # a tp=2 -> t_g=1 reshard crosses the link
    # 100 Mbit/s: the measured time cannot beat the link (tbf's burst allows a little)
    assert float(row["measured_over_link_bound"]) > 0.8, row
