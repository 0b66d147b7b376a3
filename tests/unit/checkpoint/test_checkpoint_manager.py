import json

import pytest
import torch

from rl3d.checkpoint import META_FILE, CheckpointManager, load_meta
from rl3d.checkpoint import manager as manager_mod


def _writer(payload):
    def write(tmp_dir):
        torch.save({"payload": payload}, tmp_dir / "rank_0.pt")

    return write


def _payload(path):
    return torch.load(path / "rank_0.pt", weights_only=True)["payload"]


def test_save_then_latest(tmp_path):
    mgr = CheckpointManager(tmp_path / "ckpt", keep_last=3)
    assert mgr.latest() is None
    path = mgr.save(10, _writer(10), meta={"sampler": {"epoch": 1, "offset": 4}})
    assert path == tmp_path / "ckpt" / "step_00000010"
    assert mgr.latest() == (10, path)
    assert _payload(path) == 10
    meta = load_meta(path)
    assert meta["step"] == 10 and meta["world_size"] == 1 and meta["sampler"] == {"epoch": 1, "offset": 4}
    assert meta["time"] > 0 and meta["time_utc"].endswith("Z")
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step_00000010"]


def test_keep_last_prunes_the_oldest(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=2)
    for step in (1, 2, 3, 4):
        mgr.save(step, _writer(step))
    assert [s for s, _ in mgr.checkpoints()] == [3, 4]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000003", "step_00000004"]
    assert _payload(mgr.latest()[1]) == 4


def test_a_failing_write_never_becomes_a_checkpoint(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=2)
    mgr.save(5, _writer(5))

    def crash(tmp_dir):
        (tmp_dir / "rank_0.pt").write_bytes(b"half a file")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        mgr.save(6, crash)
    assert (tmp_path / "step_00000006.tmp").is_dir()  # what a killed run leaves
    assert mgr.latest() == (5, tmp_path / "step_00000005")
    mgr.save(7, _writer(7))  # the next save removes the leftover
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000005", "step_00000007"]


def test_a_crash_between_write_and_rename_leaves_no_checkpoint(tmp_path, monkeypatch):
    mgr = CheckpointManager(tmp_path, keep_last=2)
    mgr.save(1, _writer(1))

    def killed(src, dst):
        raise KeyboardInterrupt("killed before rename")

    monkeypatch.setattr(manager_mod.os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        mgr.save(2, _writer(2))
    monkeypatch.undo()
    assert (tmp_path / "step_00000002.tmp" / META_FILE).is_file()  # fully written, never renamed
    assert mgr.latest() == (1, tmp_path / "step_00000001")


def test_leftovers_and_foreign_directories_are_ignored(tmp_path):
    (tmp_path / "step_00000099.tmp").mkdir()  # killed mid-write, higher step
    (tmp_path / "step_00000098").mkdir()  # no meta.json: never complete
    (tmp_path / "notes").mkdir()
    mgr = CheckpointManager(tmp_path, keep_last=5)
    assert mgr.latest() is None
    mgr.save(3, _writer(3))
    assert mgr.latest() == (3, tmp_path / "step_00000003")
    assert not (tmp_path / "step_00000099.tmp").exists()


def test_saving_a_step_again_replaces_it(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=2)
    mgr.save(4, _writer("old"))
    mgr.save(4, _writer("new"))
    assert [s for s, _ in mgr.checkpoints()] == [4]
    assert _payload(mgr.latest()[1]) == "new"


def test_barriers_order_the_ranks(tmp_path):
    events = []
    mgr = CheckpointManager(tmp_path, keep_last=2)

    def write(tmp_dir):
        events.append(("write", tmp_dir.name))
        (tmp_dir / "x").write_text("x")

    mgr.save(8, write, barrier=lambda: events.append(("barrier", len(list(tmp_path.iterdir())))))
    assert [e[0] for e in events] == ["barrier", "write", "barrier", "barrier"]
    assert events[1] == ("write", "step_00000008.tmp")
    assert json.loads((tmp_path / "step_00000008" / META_FILE).read_text())["step"] == 8


def test_arguments_are_checked(tmp_path):
    with pytest.raises(ValueError, match="keep_last"):
        CheckpointManager(tmp_path, keep_last=0)
    with pytest.raises(ValueError, match="step"):
        CheckpointManager(tmp_path, keep_last=1).save(-1, _writer(0))
