"""Manifests: a damaged newest checkpoint is named and skipped (or moved aside) and the one
before is used; a checkpoint of another model or layout is refused naming both."""

import json
import logging

import pytest
import torch

from rl3d.checkpoint import (
    MANIFEST_FILE,
    META_FILE,
    CheckpointManager,
    CheckpointMismatch,
    capture_rng_state,
    read_rng_state,
    verify,
)

IDENTITY = {"model": "tiny-llama", "layout": "actor 1-2-1"}
DAMAGED = ["actor/__0_1.distcp", "trainer_state.json", "rng_actor_rank1.pt"]


def write_step(step):
    """A checkpoint's files as a run writes them: megatron shards, trainer state, RNG per rank."""

    def write(tmp):
        (tmp / "actor").mkdir()
        for shard in ("__0_0.distcp", "__0_1.distcp"):
            (tmp / "actor" / shard).write_bytes(bytes(range(256)) * (8 + step))
        (tmp / "actor" / "common.pt").write_bytes(b"common" * 10)
        (tmp / "trainer_state.json").write_text(json.dumps({"step": step, "history": [{"r": 0.5}] * step}))
        for rank in (0, 1):
            torch.save(capture_rng_state(), tmp / f"rng_actor_rank{rank}.pt")

    return write


@pytest.fixture
def two_checkpoints(tmp_path):
    mgr = CheckpointManager(tmp_path / "checkpoints", keep_last=3, identity=IDENTITY)
    mgr.save(2, write_step(2))
    mgr.save(4, write_step(4))
    return mgr


def test_the_manifest_is_written_last_and_lists_every_file(two_checkpoints):
    path = two_checkpoints.path_for(4)
    manifest = json.loads((path / MANIFEST_FILE).read_text())
    files = {p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()} - {MANIFEST_FILE}
    assert set(manifest["files"]) == files and META_FILE in files
    assert manifest["files"]["trainer_state.json"]["size"] == (path / "trainer_state.json").stat().st_size
    assert manifest["identity"] == IDENTITY
    # written after everything else it lists
    assert all((path / MANIFEST_FILE).stat().st_mtime_ns >= (path / f).stat().st_mtime_ns for f in files)
    assert verify(path, checksums=True) is None
    assert two_checkpoints.resume_point(checksums=True) == (4, path)


@pytest.mark.parametrize("name", DAMAGED)
def test_a_truncated_file_falls_back_to_the_previous_checkpoint(two_checkpoints, caplog, name):
    newest = two_checkpoints.path_for(4)
    before = (newest / name).stat().st_size
    with open(newest / name, "r+b") as fh:
        fh.truncate(before // 2)
    with caplog.at_level(logging.WARNING, logger="rl3d.checkpoint.manager"):
        found = two_checkpoints.resume_point()  # what every rank does: sizes only, nothing moved
    assert found == (2, two_checkpoints.path_for(2))
    assert newest.is_dir()
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "step_00000004" in warning and name in warning and f"manifest says {before}" in warning

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rl3d.checkpoint.manager"):
        found = two_checkpoints.resume_point(checksums=True, quarantine=True)  # the launcher
    assert found == (2, two_checkpoints.path_for(2))
    assert not newest.exists() and newest.with_name("step_00000004.damaged").is_dir()
    assert "moved it to step_00000004.damaged" in caplog.records[0].getMessage()
    assert two_checkpoints.path_for(2).is_dir()  # nothing earlier was lost
    assert verify(two_checkpoints.path_for(2), checksums=True) is None


@pytest.mark.parametrize("name", DAMAGED)
def test_same_size_corruption_is_found_by_the_checksums(two_checkpoints, name):
    newest = two_checkpoints.path_for(4)
    data = bytearray((newest / name).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (newest / name).write_bytes(bytes(data))
    assert two_checkpoints.resume_point() == (4, newest)  # sizes alone cannot see it
    assert name in verify(newest, checksums=True) and "CRC-32" in verify(newest, checksums=True)
    assert two_checkpoints.resume_point(checksums=True) == (2, two_checkpoints.path_for(2))


def test_a_missing_file_or_a_torn_manifest_is_damage(two_checkpoints):
    newest = two_checkpoints.path_for(4)
    (newest / "rng_actor_rank0.pt").unlink()
    assert "rng_actor_rank0.pt: missing" in verify(newest)
    two_checkpoints.save(6, write_step(6))
    six = two_checkpoints.path_for(6)
    (six / MANIFEST_FILE).write_text('{"files": {"meta.json": ')
    assert "unreadable manifest" in verify(six)
    assert two_checkpoints.resume_point() == (2, two_checkpoints.path_for(2))


def test_every_checkpoint_damaged_means_none(two_checkpoints):
    for step in (2, 4):
        (two_checkpoints.path_for(step) / "trainer_state.json").write_text("{}")
    assert two_checkpoints.resume_point(quarantine=True) is None
    assert sorted(p.name for p in two_checkpoints.root.iterdir()) == [
        "step_00000002.damaged",
        "step_00000004.damaged",
    ]


@pytest.mark.parametrize(
    "identity, field, named",
    [
        ({"model": "tiny-qwen2", "layout": "actor 1-2-1"}, "model", ("'tiny-llama'", "'tiny-qwen2'")),
        ({"model": "tiny-llama", "layout": "actor 1-1-2"}, "layout", ("'actor 1-2-1'", "'actor 1-1-2'")),
    ],
)
def test_a_checkpoint_of_another_model_or_layout_is_refused(two_checkpoints, identity, field, named):
    other = CheckpointManager(two_checkpoints.root, keep_last=3, identity=identity)
    with pytest.raises(CheckpointMismatch) as info:
        other.resume_point()
    assert info.value.field == field and all(n in str(info.value) for n in named)
    assert "step_00000004" in str(info.value)


def test_checkpoints_without_a_manifest_still_resume(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=2, identity=IDENTITY)
    mgr.save(3, write_step(3))
    (mgr.path_for(3) / MANIFEST_FILE).unlink()  # as written before manifests existed
    assert mgr.resume_point(checksums=True) == (3, mgr.path_for(3))


def test_rng_state_loads_weights_only_and_a_damaged_file_is_named(tmp_path):
    path = tmp_path / "rng.pt"
    torch.save(capture_rng_state(), path)
    state = read_rng_state(path)  # weights_only=True: only tensors and plain values inside
    assert state["torch"].dtype == torch.uint8 and isinstance(state["python"], tuple)
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(ValueError, match=r"rng\.pt: cannot load RNG state"):
        read_rng_state(path)
