"""`rl3d convert` writes into a temporary directory and renames it on success: a failure exits 2
naming the file and the tensor, and leaves an existing output exactly as it was."""

import shutil

import pytest
from safetensors.torch import load_file, save_file

from rl3d.models.cli_convert import main


def snapshot(directory):
    return {
        p.relative_to(directory).as_posix(): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def convert_fails(capsys, *argv):
    code = main(list(argv))
    err = capsys.readouterr().err
    assert code == 2, err
    # one line from the command (another test's logging handler may add noise to stderr)
    (line,) = [line for line in err.splitlines() if line.startswith("rl3d convert:")]
    return line


@pytest.fixture
def good_output(tiny_hf_dirs, tmp_path):
    dst = tmp_path / "mcore"
    assert main(["hf2mcore", "--src", str(tiny_hf_dirs["tiny-llama"]), "--dst", str(dst), "--tp", "2"]) == 0
    return dst


def no_leftovers(dst):
    assert [p.name for p in dst.parent.iterdir() if p.name.startswith(f".{dst.name}.")] == []


def test_truncated_safetensors_leaves_the_good_output(capsys, tiny_hf_dirs, good_output, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(tiny_hf_dirs["tiny-llama"], bad)
    weights = bad / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:5000])
    before = snapshot(good_output)
    err = convert_fails(capsys, "hf2mcore", "--src", str(bad), "--dst", str(good_output), "--tp", "2")
    assert "bad/model.safetensors" in err
    assert snapshot(good_output) == before
    no_leftovers(good_output)


def test_missing_tensor_is_named(capsys, tiny_hf_dirs, good_output, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(tiny_hf_dirs["tiny-llama"], bad)
    tensors = load_file(bad / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, bad / "model.safetensors")
    before = snapshot(good_output)
    err = convert_fails(capsys, "hf2mcore", "--src", str(bad), "--dst", str(good_output), "--tp", "2")
    assert "no tensor 'model.layers.1.mlp.up_proj.weight'" in err and str(bad) in err
    assert snapshot(good_output) == before
    no_leftovers(good_output)


def test_tensor_of_the_wrong_shape_is_named(capsys, tiny_hf_dirs, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(tiny_hf_dirs["tiny-llama"], bad)
    tensors = load_file(bad / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"][:10].clone()
    save_file(tensors, bad / "model.safetensors")
    err = convert_fails(capsys, "hf2mcore", "--src", str(bad), "--dst", str(tmp_path / "new"))
    assert "model.norm.weight (10,)" in err
    assert not (tmp_path / "new").exists()
    no_leftovers(tmp_path / "new")


def test_mcore2hf_of_a_damaged_shard_leaves_the_hf_output(capsys, good_output, tmp_path):
    hf = tmp_path / "hf"
    assert main(["mcore2hf", "--src", str(good_output), "--dst", str(hf)]) == 0
    before = snapshot(hf)
    shard = good_output / "mp_rank_01_000" / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:3000])
    err = convert_fails(capsys, "mcore2hf", "--src", str(good_output), "--dst", str(hf))
    assert "mp_rank_01_000/model.safetensors" in err
    assert snapshot(hf) == before
    no_leftovers(hf)


def test_a_successful_conversion_replaces_the_old_output_whole(tiny_hf_dirs, good_output):
    (good_output / "stale.txt").write_text("from an older conversion")
    assert (
        main(["hf2mcore", "--src", str(tiny_hf_dirs["tiny-llama"]), "--dst", str(good_output), "--tp", "1"])
        == 0
    )
    assert not (good_output / "stale.txt").exists()
    assert not (good_output / "mp_rank_01_000").exists()  # no shard of the old tp=2 layout
    no_leftovers(good_output)
