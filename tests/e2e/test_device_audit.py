"""Device discipline, checked on CPU: the 2-rank GRPO loop runs under an audit (a torch function
mode in every rank, `device_audit/sitecustomize.py`) that tracks where each tensor is meant to
live. No controller-made tensor may reach a model forward or a tensor collective without an
explicit move, and no worker may hand the controller a tensor still on its device."""

import json
import os
from pathlib import Path

import pytest
from train_helpers import GRPO, run_train, train_env

pytestmark = pytest.mark.e2e


def test_no_tensor_crosses_between_controller_and_device_unmoved(tmp_path, monkeypatch):
    audit = tmp_path / "audit"
    audit.mkdir()
    env = train_env()
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent / "device_audit"), env["PYTHONPATH"]])
    env["RL3D_DEVICE_AUDIT"] = str(audit)
    monkeypatch.setattr("train_helpers.train_env", lambda: env)
    proc = run_train(GRPO, tmp_path / "run", "trainer.total_steps=2", "checkpoint.save_every=0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    reports = {p.name: json.loads(p.read_text()) for p in sorted(audit.glob("rank*.json"))}
    assert sorted(reports) == ["rank0.json", "rank1.json"]  # the audit ran in both ranks
    found = {(v["kind"], v["where"], v["what"]) for vs in reports.values() for v in vs}
    assert found == set(), "\n".join(sorted(f"{k} at {w}: {what}" for k, w, what in found))
