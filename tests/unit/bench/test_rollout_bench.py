"""`rl3d bench rollout` and `benchmarks/rollout_vs_generate.py`: the JSON contract on a tiny batch (no timing
assertions: the machine may be busy)."""

import json
import runpy
import sys
from pathlib import Path

import pytest

from rl3d.cli import main

KEYS = {"torch_tokens_per_s": float, "hf_tokens_per_s": float, "model": str, "batch": int, "new_tokens": int}
TINY = ["--batch", "3", "--new-tokens", "4", "--prompt-len", "6", "--repeats", "1"]
SCRIPT = Path(__file__).parents[3] / "benchmarks" / "rollout_vs_generate.py"


def check_contract(out: dict, model: str) -> None:
    assert set(out) == set(KEYS)
    for key, kind in KEYS.items():
        assert type(out[key]) is kind, (key, out[key])
    assert out["torch_tokens_per_s"] > 0 and out["hf_tokens_per_s"] > 0
    assert (out["model"], out["batch"], out["new_tokens"]) == (model, 3, 4)


def test_cli_json_contract_and_files(capsys, tmp_path):
    assert main(["bench", "rollout", "--json", *TINY, "--out", str(tmp_path)]) == 0
    check_contract(json.loads(capsys.readouterr().out), "tiny-llama")
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["greedy_rows_equal"] == 1.0  # same weights, greedy: the same tokens in both
    rows = (tmp_path / "rollout.csv").read_text().splitlines()
    assert rows[0].startswith("engine,") and [r.split(",")[0] for r in rows[1:]] == ["torch", "hf"]
    assert (tmp_path / "rollout.md").read_text().count("|") > 0


def test_script_json_contract_sampling_qwen2(capsys, tmp_path, monkeypatch):
    args = ["--json", *TINY, "--model", "tiny-qwen2", "--temperature", "0.7", "--out", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), *args])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(SCRIPT), run_name="__main__")
    assert exit_.value.code == 0
    check_contract(json.loads(capsys.readouterr().out), "tiny-qwen2")


def test_bad_arguments_are_exit_2(capsys):
    assert main(["bench", "rollout", "--batch", "0"]) == 2
    assert "--batch must be >= 1" in capsys.readouterr().err
    assert main(["bench", "rollout", "--prompt-len", "500", "--new-tokens", "64"]) == 2
    assert "max_position_embeddings" in capsys.readouterr().err


def test_device_cuda_without_cuda_is_exit_2(capsys, monkeypatch):
    monkeypatch.setattr("rl3d.utils.device.cuda_available", lambda: False)  # looked up at --device cuda
    assert main(["bench", "rollout", "--device", "cuda"]) == 2
    assert "--device cuda: no CUDA device here" in capsys.readouterr().err
