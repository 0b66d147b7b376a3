"""`benchmarks/transition_vs_megatron.py` at its smallest: rl3d's transition and megatron-core's
resharding on the same real megatron GPTModels (tiny-llama, 2 gloo ranks, TP folding into micro-DP
and PP folding into micro-DP). megatron given rl3d's generation groups moves exactly rl3d's bytes
on every rank, and every generation weight of all three sides is right bit for bit (megatron's
equal to rl3d's). No timing is asserted: the machine may be busy."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed
ROOT = Path(__file__).resolve().parents[3]


def test_megatron_resharding_moves_rl3d_bytes_into_rl3d_weights(tmp_path):
    paths = [str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "transition_vs_megatron.py"), "--models", "tiny-llama",
         "--layouts", "1-2-1:1,2-1-1:1:1", "--repeats", "1", "--warmup", "0", "--out", str(tmp_path)],
        cwd=ROOT, env=os.environ | {"PYTHONPATH": os.pathsep.join(paths)}, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads((tmp_path / "result.json").read_text())["rows"]
    for name in ("transition_vs_megatron.csv", "transition_vs_megatron.md", "transition_vs_megatron.png"):
        assert (tmp_path / name).stat().st_size > 0
    by = {(r["train"], r["side"]): r for r in rows}
    assert len(by) == 6
    for train in ("1-2-1", "2-1-1"):
        rl3d, ours = by[(train, "rl3d")], by[(train, "megatron_rl3d_groups")]
        assert rl3d["recv_mb_max"] > 0 and rl3d["checked"] > 0, train
        assert ours["recv_bytes_per_rank"] == rl3d["recv_bytes_per_rank"], train
        assert ours["send_bytes_per_rank"] == rl3d["send_bytes_per_rank"], train
        assert ours["bytes_equal_rl3d"] is True, train
        for side in ("rl3d", "megatron_rl3d_groups", "megatron_default"):
            assert by[(train, side)]["bit_equal"] is True, (train, side)
    # rl3d's phases add up to its to_generation time (the rest is bookkeeping)
    assert by[("1-2-1", "rl3d")]["phase_collective"] > 0
