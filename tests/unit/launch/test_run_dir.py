"""Runs never mix: `resume: never` over an earlier run, a different config, or a checkpoint of
another model is refused (exit 2, one line, nothing touched); `--overwrite` starts over."""

from pathlib import Path

import pytest

from rl3d.checkpoint import CheckpointManager, checkpoint_identity
from rl3d.cli import EXIT_BAD_INPUT, main
from rl3d.config import load_config, write_resolved_config
from rl3d.launch.preflight import check_run_dir

ROOT = Path(__file__).resolve().parents[3]
GRPO = str(ROOT / "recipes/quickstart_cpu_grpo.yaml")


def earlier_run(run_dir: Path, *overrides: str, identity=None) -> dict[str, bytes]:
    """A run dir as an earlier run left it; returns every file's bytes."""
    loaded = load_config(GRPO, [f"trainer.run_dir={run_dir}", *overrides])
    write_resolved_config(loaded, run_dir)
    mgr = CheckpointManager(
        run_dir / "checkpoints", keep_last=2, identity=identity or checkpoint_identity(loaded.config)
    )
    for step in (2, 4):
        mgr.save(step, lambda tmp, s=step: (tmp / "trainer_state.json").write_text(f'{{"step": {s}}}'))
    (run_dir / "metrics.jsonl").write_text("".join(f'{{"step": {s}, "r": 0.5}}\n' for s in (1, 2, 3, 4)))
    (run_dir / "notes.txt").write_text("the user's own file")
    return snapshot(run_dir)


def snapshot(run_dir: Path) -> dict[str, bytes]:
    files = [p for p in sorted(run_dir.rglob("*")) if p.is_file()]
    return {p.relative_to(run_dir).as_posix(): p.read_bytes() for p in files}


def refused(capsys, run_dir: Path, *overrides: str) -> str:
    before = snapshot(run_dir)
    code = main(["train", "--dry-run", GRPO, f"trainer.run_dir={run_dir}", *overrides])
    err = capsys.readouterr().err
    assert code == EXIT_BAD_INPUT, err
    assert len(err.strip().splitlines()) == 1, err
    assert snapshot(run_dir) == before  # nothing earlier was lost or changed
    return err


def test_resume_never_over_an_earlier_run_is_refused(capsys, tmp_path):
    earlier_run(tmp_path)
    err = refused(capsys, tmp_path, "checkpoint.resume=never")
    assert "command line: checkpoint.resume: 'never'" in err
    assert "step_00000004" in err and "--overwrite" in err


def test_overwrite_removes_the_earlier_runs_outputs_only(tmp_path):
    earlier_run(tmp_path)
    (tmp_path / "slurm").mkdir()
    loaded = load_config(GRPO, [f"trainer.run_dir={tmp_path}", "checkpoint.resume=never"])
    removed = check_run_dir(loaded, overwrite=True)
    assert set(removed) == {"checkpoints", "metrics.jsonl", "resolved_config.yaml"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "slurm"]
    check_run_dir(loaded)  # now a fresh run dir


def test_a_different_config_is_refused_naming_the_keys(capsys, tmp_path):
    files = earlier_run(tmp_path)
    err = refused(capsys, tmp_path, "model.name=tiny-llama-mha", "rollout.n=8")
    assert "command line: model.name:" in err and "differs in model.name, rollout.n" in err
    assert snapshot(tmp_path)["resolved_config.yaml"] == files["resolved_config.yaml"]


def test_restart_keys_may_change_and_the_old_config_is_kept(capsys, tmp_path):
    earlier_run(tmp_path)
    old = (tmp_path / "resolved_config.yaml").read_text()
    code = main(["train", "--dry-run", GRPO, f"trainer.run_dir={tmp_path}", "trainer.total_steps=400"])
    assert code == 0, capsys.readouterr().err
    loaded = load_config(GRPO, [f"trainer.run_dir={tmp_path}", "trainer.total_steps=400"])
    write_resolved_config(loaded, tmp_path)
    assert (tmp_path / "resolved_config.1.yaml").read_text() == old
    assert "total_steps: 400" in (tmp_path / "resolved_config.yaml").read_text()


def test_write_resolved_config_never_replaces_another_runs(tmp_path):
    from rl3d.config import ConfigError

    earlier_run(tmp_path)
    loaded = load_config(GRPO, [f"trainer.run_dir={tmp_path}", "actor.optim.lr=1e-4"])
    with pytest.raises(ConfigError, match=r"actor\.optim\.lr: .*differs in actor\.optim\.lr"):
        write_resolved_config(loaded, tmp_path)


def test_a_checkpoint_of_another_model_is_refused_naming_both(capsys, tmp_path):
    earlier_run(tmp_path, identity={"model": "tiny-qwen2", "layout": "actor 1-2-1"})
    (tmp_path / "resolved_config.yaml").unlink()  # only the checkpoint's manifest can tell
    err = refused(capsys, tmp_path)
    assert "model.name:" in err and "'tiny-qwen2'" in err and "'tiny-llama'" in err


def test_the_launcher_moves_a_damaged_checkpoint_aside(capsys, tmp_path):
    earlier_run(tmp_path)
    state = tmp_path / "checkpoints/step_00000004/trainer_state.json"
    state.write_text('{"st')  # truncated
    loaded = load_config(GRPO, [f"trainer.run_dir={tmp_path}"])
    check_run_dir(loaded, launcher=False)  # a rank: reads only
    assert state.exists()
    check_run_dir(loaded)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "step_00000002",
        "step_00000004.damaged",
    ]


def test_a_moved_run_dir_still_resumes(tmp_path):
    earlier_run(tmp_path / "old")
    (tmp_path / "old").rename(tmp_path / "new")  # its resolved config names the old path
    check_run_dir(load_config(GRPO, [f"trainer.run_dir={tmp_path / 'new'}"]))
