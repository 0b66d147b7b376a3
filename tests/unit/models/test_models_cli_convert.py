"""`rl3d convert` entry points (wired into rl3d.cli by add_convert_arguments / run_convert)."""

import argparse
import json

import pytest
import torch

from rl3d.models.cli_convert import main, parse_size
from rl3d.models.safetensors_io import ShardedReader


def test_hf2mcore_then_mcore2hf(tiny_hf_dirs, tmp_path, capsys):
    src = tiny_hf_dirs["tiny-llama"]
    assert main(["hf2mcore", "--src", str(src), "--dst", str(tmp_path / "m"), "--tp", "2", "--pp", "2"]) == 0
    assert "tp=2 pp=2" in capsys.readouterr().out
    assert main(["mcore2hf", "--src", str(tmp_path / "m"), "--dst", str(tmp_path / "h")]) == 0
    with ShardedReader(src) as a, ShardedReader(tmp_path / "h") as b:
        assert all(torch.equal(a.get(k), b.get(k)) for k in a.weight_map)


def test_unsupported_model_type_exits_2(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma"}))
    assert main(["hf2mcore", "--src", str(tmp_path), "--dst", str(tmp_path / "o")]) == 2
    assert "unsupported HF model_type 'gemma'" in capsys.readouterr().err


def test_missing_source_exits_2(tmp_path, capsys):
    assert main(["mcore2hf", "--src", str(tmp_path / "nope"), "--dst", str(tmp_path / "o")]) == 2
    assert "rl3d convert:" in capsys.readouterr().err


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("512") == 512
    with pytest.raises(argparse.ArgumentTypeError):
        parse_size("lots")
