"""The multi-GPU check's own scripts on 2 gloo ranks under torchrun, as they would start on
NCCL: the reshard that trades expert parts both ways (one batch per phase, every generation
weight bit for bit) and the communicator-memory readings (no counts off CUDA)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed
ROOT = Path(__file__).resolve().parents[2]


def torchrun(script: str, out: Path) -> dict:
    paths = [str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(ROOT / "benchmarks" / script), "--out", str(out), "--device", "cpu"],
        cwd=ROOT, env=os.environ | {"PYTHONPATH": os.pathsep.join(paths)}, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(next(out.glob("*.json")).read_text())


def test_batched_p2p_script_on_gloo(tmp_path):
    result = torchrun("batched_p2p_nccl.py", tmp_path)
    assert (result["backend"], result["world"], result["ok"]) == ("gloo", 2, True)
    for rank in result["ranks"]:
        assert (
            rank["batches_as_planned"]
            and rank["wrong"] == []
            and rank["both_ways_with"] == [1 - rank["rank"]]
        )
        assert rank["exchange"] == [float(2 - rank["rank"])] * 3


def test_nccl_memory_script_on_gloo(tmp_path):
    result = torchrun("nccl_memory.py", tmp_path)
    assert (result["backend"], result["world"], result["layout"]) == ("gloo", 2, "train 1-2-1, t_g 1")
    for rank in result["ranks"]:
        assert set(rank["readings"]) == {"context", "world_group", "world_all_reduce", "megatron_groups",
                                         "hybrid_groups"}  # fmt: skip
        assert rank["all_reduced_groups"]["megatron"] == 4 and rank["all_reduced_groups"]["hybrid"] > 0
