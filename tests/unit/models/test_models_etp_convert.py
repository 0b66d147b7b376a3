"""HF <-> Megatron conversion with the experts split over an expert TP size apart from tp
(`--etp`): bit for bit round trips, which file holds what, and reading any shard back."""

import json

import pytest
import torch

from rl3d.models.cli_convert import main
from rl3d.models.convert import McoreReader, expert_dir_name, hf_to_mcore, mcore_to_hf, shard_dir_name
from rl3d.models.safetensors_io import ShardedReader

CASES = [  # (model, tp, pp, ep, etp)
    ("tiny-qwen3-moe", 2, 1, 2, 1),
    ("tiny-qwen3-moe", 2, 2, 4, 1),
    ("tiny-qwen2-moe", 2, 1, 2, 1),  # the shared expert is dense: split by tp
    ("tiny-qwen3-moe", 2, 1, 1, 1),
]


def _tensors(directory):
    with ShardedReader(directory) as reader:
        return {name: reader.get(name) for name in reader.weight_map}


@pytest.mark.parametrize(("name", "tp", "pp", "ep", "etp"), CASES)
def test_round_trip_bit_for_bit(tiny_moe_hf_dirs, tmp_path, name, tp, pp, ep, etp):
    src = tiny_moe_hf_dirs[name]
    meta = hf_to_mcore(src, tmp_path / "mcore", tp=tp, pp=pp, ep=ep, etp=etp)
    assert (meta.tp, meta.pp, meta.ep, meta.etp) == (tp, pp, ep, etp)
    assert json.loads((tmp_path / "mcore" / "rl3d_meta.json").read_text())["etp"] == etp
    mcore_to_hf(tmp_path / "mcore", tmp_path / "hf")
    before, after = _tensors(src), _tensors(tmp_path / "hf")
    assert sorted(before) == sorted(after)
    for key, tensor in before.items():
        assert after[key].dtype == tensor.dtype and torch.equal(after[key], tensor), key


def test_dense_files_by_tp_expert_files_by_etp(tiny_moe_hf_dirs, tmp_path):
    src = tiny_moe_hf_dirs["tiny-qwen3-moe"]  # 8 experts of width 32, 2 layers, hidden 64
    hf_to_mcore(src, tmp_path / "m", tp=2, pp=1, ep=2, etp=1)
    dirs = sorted(p.name for p in (tmp_path / "m").iterdir() if p.is_dir() and p.name != "hf_extra")
    assert dirs == [
        expert_dir_name(0, 0, 0),
        expert_dir_name(0, 0, 1),
        shard_dir_name(0, 0),
        shard_dir_name(1, 0),
    ]
    dense = _tensors(tmp_path / "m" / shard_dir_name(1, 0))
    assert not any(".experts." in k for k in dense)
    assert dense["decoder.layers.0.mlp.router.weight"].shape == (8, 64)
    experts = _tensors(tmp_path / "m" / expert_dir_name(0, 0, 1))  # EP rank 1: experts 4-7, whole
    assert sorted(experts) == sorted(
        f"decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc{f}.weight"
        for i in (0, 1)
        for e in range(4)
        for f in (1, 2)
    )
    with ShardedReader(src) as hf:
        down = hf.get("model.layers.1.mlp.experts.7.down_proj.weight")
    assert torch.equal(experts["decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight"], down)
    # any layout reads its shards: an expert cut by tp 2, a dense weight by tp 2 from its own file
    hf_to_mcore(src, tmp_path / "one", tp=1, pp=1, ep=1)
    with McoreReader(tmp_path / "m") as m, McoreReader(tmp_path / "one") as one:
        name = "decoder.layers.1.mlp.experts.local_experts.6.linear_fc2.weight"
        assert torch.equal(
            m.shard(name, 2, 1, one.meta.padded_vocab * 2), one.shard(name, 2, 1, one.meta.padded_vocab * 2)
        )
        assert torch.equal(m.shard(name, 1, 0, m.meta.padded_vocab), one.full(name))
        qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
        assert torch.equal(m.shard(qkv, 2, 1, m.meta.padded_vocab), one.shard(qkv, 2, 1, m.meta.padded_vocab))


def test_cli_etp_and_refusals(tiny_moe_hf_dirs, tmp_path, capsys):
    src = tiny_moe_hf_dirs["tiny-qwen3-moe"]
    args = ["hf2mcore", "--src", str(src), "--dst", str(tmp_path / "m"), "--tp", "2", "--ep", "2"]
    assert main([*args, "--etp", "1"]) == 0
    assert "tp=2 pp=1 ep=2 etp=1" in capsys.readouterr().out
    assert main([*args, "--etp", "2"]) == 0  # etp = tp: the default layout, no expert files
    assert not any(p.name.startswith("expert_rank") for p in (tmp_path / "m").iterdir())
    assert main([*args, "--etp", "4"]) != 0
    assert "etp=4 must divide tp=2" in capsys.readouterr().err
