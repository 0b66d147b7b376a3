"""CheckpointManager on 2 gloo ranks: every rank's files land in one complete directory."""

import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from rl3d.checkpoint import CheckpointManager, load_meta
from rl3d.testing.spawn import run_distributed


def _save_three_steps(rank, world_size, root):
    mgr = CheckpointManager(Path(root), keep_last=2)
    seen = []
    for step in (1, 2, 3):

        def write(tmp_dir, step=step):
            if rank == 1:
                time.sleep(0.3)  # a slow rank: rank 0 must not rename before it has written
            torch.save({"rank": rank, "step": step}, tmp_dir / f"rank_{rank}.pt")

        path = mgr.save(step, write, rank=rank, world_size=world_size, barrier=dist.barrier)
        # after save returns, every rank sees the complete checkpoint
        seen.append((mgr.latest()[0], sorted(p.name for p in path.iterdir())))
    return seen


@pytest.mark.distributed
def test_two_rank_save(tmp_path):
    root = tmp_path / "ckpt"
    results = run_distributed(_save_three_steps, 2, str(root), timeout_s=60)
    expected = [(step, ["manifest.json", "meta.json", "rank_0.pt", "rank_1.pt"]) for step in (1, 2, 3)]
    assert results == [expected, expected]
    assert sorted(p.name for p in root.iterdir()) == ["step_00000002", "step_00000003"]
    latest = root / "step_00000003"
    assert load_meta(latest)["world_size"] == 2
    for rank in (0, 1):
        assert torch.load(latest / f"rank_{rank}.pt", weights_only=True) == {"rank": rank, "step": 3}
