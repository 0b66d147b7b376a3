"""The preflight: bad run-time input exits 2 with one line naming the key and the file, before
any rank starts and before anything is written."""

from pathlib import Path

import pytest

from rl3d.cli import EXIT_BAD_INPUT, main

ROOT = Path(__file__).resolve().parents[3]
GRPO = str(ROOT / "recipes/quickstart_cpu_grpo.yaml")
RECIPE_FILE = "quickstart_cpu_grpo.yaml"


@pytest.fixture(scope="module")
def parquet(tmp_path_factory):
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("data")
    good = root / "good.parquet"
    pq.write_table(pa.table({"prompt": ["a b", "c d"], "answer": ["1", "2"]}), good)
    no_prompt = root / "no_prompt.parquet"
    pq.write_table(pa.table({"question": ["a b"], "answer": ["1"]}), no_prompt)
    garbage = root / "garbage.parquet"
    garbage.write_bytes(b"not parquet at all")
    return {"good": good, "no_prompt": no_prompt, "garbage": garbage}


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    from rl3d.testing.tiny_hf import save_tiny_hf_model

    root = tmp_path_factory.mktemp("hf")
    for name in ("tiny-llama", "tiny-qwen2"):
        save_tiny_hf_model(name, root / name, seed=3)
    no_weights = root / "no-weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text((root / "tiny-llama" / "config.json").read_text())
    broken = root / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "llama", "hidden_')
    return {
        "llama": root / "tiny-llama",
        "qwen": root / "tiny-qwen2",
        "no_weights": no_weights,
        "broken": broken,
    }


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().err


def assert_one_line(err: str, *parts: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    for part in parts:
        assert part in lines[0], (part, lines[0])


def train_fails(capsys, tmp_path, *overrides: str) -> str:
    """`rl3d train` refuses with exit 2 and one line, and writes nothing into the run dir."""
    run_dir = tmp_path / "run"
    code, err = run_cli(capsys, "train", GRPO, f"trainer.run_dir={run_dir}", *overrides)
    assert code == EXIT_BAD_INPUT, err
    assert not run_dir.exists()  # nothing started, nothing written
    return err


def test_missing_train_file(capsys, tmp_path):
    err = train_fails(capsys, tmp_path, f"data.train_files=[{tmp_path / 'nope.parquet'}]")
    assert_one_line(err, "command line: data.train_files[0]", "nope.parquet: no such file")


def test_parquet_without_the_prompt_column(capsys, tmp_path, parquet):
    err = train_fails(capsys, tmp_path, f"data.train_files=[{parquet['good']},{parquet['no_prompt']}]")
    assert_one_line(err, "data.train_files[1]", "no_prompt.parquet has no column 'prompt'", "question")


def test_template_column_and_answer_column(capsys, tmp_path, parquet):
    err = train_fails(
        capsys, tmp_path, f"data.train_files=[{parquet['good']}]", "data.template={topic}: {prompt}"
    )
    assert_one_line(err, "data.train_files[0]", "no column 'topic' (data.template)")
    err = train_fails(
        capsys,
        tmp_path,
        f"data.train_files=[{parquet['good']}]",
        "data.answer_key=solution",
        "reward.fn=gsm8k",
    )
    assert_one_line(err, "data.train_files[0]", "no column 'solution' (data.answer_key)")


def test_not_a_parquet_file(capsys, tmp_path, parquet):
    err = train_fails(capsys, tmp_path, f"data.train_files=[{parquet['garbage']}]")
    assert_one_line(err, "data.train_files[0]", "garbage.parquet: not a readable parquet file")


def test_missing_tokenizer(capsys, tmp_path, parquet):
    err = train_fails(
        capsys, tmp_path, f"data.train_files=[{parquet['good']}]", f"data.tokenizer={tmp_path / 'tok'}"
    )
    assert_one_line(err, "data.tokenizer", "tok: no such file or directory")


def test_hf_path_that_does_not_exist(capsys, tmp_path):
    err = train_fails(capsys, tmp_path, f"model.hf_path={tmp_path / 'missing'}")
    assert_one_line(err, "command line: model.hf_path", "missing: no such directory")


def test_hf_path_of_another_model(capsys, tmp_path, hf_dirs):
    err = train_fails(capsys, tmp_path, f"model.hf_path={hf_dirs['qwen']}")
    assert_one_line(err, "model.hf_path", "config.json holds a model with", "model.name 'tiny-llama'")


@pytest.mark.parametrize(
    "which, message", [("no_weights", "no *.safetensors"), ("broken", "config.json: JSONDecode")]
)
def test_hf_path_without_weights_or_with_a_broken_config(capsys, tmp_path, hf_dirs, which, message):
    err = train_fails(capsys, tmp_path, f"model.hf_path={hf_dirs[which]}")
    assert_one_line(err, "model.hf_path", message)


def test_matching_hf_path_and_data_pass(capsys, tmp_path, hf_dirs, parquet):
    args = [f"model.hf_path={hf_dirs['llama']}", f"data.train_files=[{parquet['good']}]", "reward.fn=gsm8k"]
    code, err = run_cli(capsys, "validate", "--preflight", GRPO, *args)
    assert code == 0, err
    code, err = run_cli(capsys, "train", "--dry-run", GRPO, f"trainer.run_dir={tmp_path / 'run'}", *args)
    assert code == 0, err


def test_prompt_plus_response_beyond_the_model(capsys, tmp_path):
    err = train_fails(capsys, tmp_path, "rollout.max_new_tokens=600")
    assert_one_line(err, "rollout.max_new_tokens", "16 + rollout.max_new_tokens 600 = 616", "512")
    # `validate` catches it too: it needs nothing but the recipe
    code, err = run_cli(capsys, "validate", GRPO, "data.max_prompt_length=510")
    assert code == EXIT_BAD_INPUT
    assert_one_line(err, "510 + rollout.max_new_tokens 8 = 518 tokens exceeds tiny-llama")


@pytest.mark.parametrize(
    "override, key",
    [
        ("trainer.seed=-5", "command line: trainer.seed: must be in [0, 2**32), got -5"),
        ("trainer.seed=4294967296", "trainer.seed: must be in [0, 2**32)"),
        ("data.synthetic.seed=-1", "data.synthetic.seed: must be in [0, 2**32)"),
        ("rollout.stop_token_ids=[300]", "rollout.stop_token_ids[0]: 300 is outside the vocabulary [0, 256)"),
    ],
)
def test_seeds_and_sizes_in_range(capsys, tmp_path, override, key):
    err = train_fails(capsys, tmp_path, override)
    assert_one_line(err, key)


@pytest.mark.parametrize(
    "override, key, message",
    [
        ("reward.fn=no_such_pkg.rewards:score", "reward.fn", "module 'no_such_pkg.rewards' not found"),
        (
            "reward.cost_fn=os.path:no_such_cost",
            "reward.cost_fn",
            "'os.path' has no attribute 'no_such_cost'",
        ),
        (
            "trainer.hooks.on_step_end=json:nope",
            "trainer.hooks.on_step_end",
            "'json' has no attribute 'nope'",
        ),
    ],
)
def test_user_code_import_paths_resolve(capsys, tmp_path, override, key, message):
    err = train_fails(capsys, tmp_path, override)
    assert_one_line(err, f"command line: {key}", message)


def test_recipe_file_is_named_for_its_own_keys(capsys, tmp_path):
    # trainer.seed comes from the recipe; a bad data file from the command line
    err = train_fails(capsys, tmp_path, "data.train_files=[/no/such/file.parquet]")
    assert "command line" in err
    from rl3d.config import load_config
    from rl3d.launch.preflight import PreflightError, preflight

    loaded = load_config(GRPO, ["rollout.max_new_tokens=600"])
    with pytest.raises(PreflightError) as info:
        preflight(loaded)
    assert info.value.key == "rollout.max_new_tokens" and info.value.source == "command line"


def test_slurm_checks_what_exists_here(capsys, tmp_path, parquet):
    import argparse

    from rl3d.launch.slurm import add_slurm_arguments, run_slurm

    parser = argparse.ArgumentParser(prog="rl3d")
    add_slurm_arguments(parser.add_subparsers(dest="command").add_parser("slurm"))
    base = ["slurm", GRPO, "--nodes", "1", "--dry-run", f"trainer.run_dir={tmp_path / 'run'}"]
    # a file that is absent here may exist on the nodes: a warning, and the job checks it there
    assert run_slurm(parser.parse_args([*base, "data.train_files=[/nodes/only.parquet]"])) == 0
    assert "does not exist here" in capsys.readouterr().err
    # a file that is here and wrong is refused now
    code = main([*base, f"data.train_files=[{parquet['no_prompt']}]"])
    assert code == EXIT_BAD_INPUT
    assert_one_line(capsys.readouterr().err, "data.train_files[0]", "has no column 'prompt'")
    code = main([*base, "trainer.seed=-5"])
    assert code == EXIT_BAD_INPUT
    assert_one_line(capsys.readouterr().err, "trainer.seed")


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory):
    """verl-layout parquet files (one good, one of ShareGPT roles, one of word lists) and a
    tokenizer directory with a chat template."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from rl3d.testing.chat import save_chat_tokenizer, verl_row, write_verl_parquet

    root = tmp_path_factory.mktemp("chat")
    rows = [verl_row("what is two ?", "2", 0), verl_row("what is three ?", "3", 1)]
    good = write_verl_parquet(root / "verl.parquet", rows)
    shared = [dict(row, prompt=[{"role": "human", "content": "what is two ?"}]) for row in rows]
    sharegpt = write_verl_parquet(root / "sharegpt.parquet", shared)
    words = root / "words.parquet"
    pq.write_table(pa.table({"prompt": [["what", "is"]], "answer": ["1"]}), words)
    return {"good": good, "sharegpt": sharegpt, "words": words, "tok": save_chat_tokenizer(root / "tok")}


def test_chat_data_column_types_and_roles(capsys, tmp_path, chat_data):
    tok = f"data.tokenizer={chat_data['tok']}"
    err = train_fails(capsys, tmp_path, f"data.train_files=[{chat_data['sharegpt']}]", tok)
    assert_one_line(
        err,
        "data.train_files[0]",
        "sharegpt.parquet:0: column 'prompt' (data.prompt_key): message 0 has role 'human'",
    )
    err = train_fails(capsys, tmp_path, f"data.train_files=[{chat_data['words']}]", tok)
    assert_one_line(err, "data.train_files[0]", "column 'prompt' (data.prompt_key) is list<element: string>")
    good = f"data.train_files=[{chat_data['good']}]"
    err = train_fails(capsys, tmp_path, good, tok, f"data.val_files=[{chat_data['words']}]")
    assert_one_line(err, "data.val_files[0]", "words.parquet: column 'prompt' (data.prompt_key) is list")
    err = train_fails(capsys, tmp_path, f"data.train_files=[{chat_data['good']}]")  # synthetic vocabulary
    assert_one_line(err, "data.chat_template", "verl.parquet: the prompts need the tokenizer's chat template")
    code, err = run_cli(
        capsys,
        "validate",
        "--preflight",
        GRPO,
        f"data.train_files=[{chat_data['good']}]",
        tok,
        "reward.fn=gsm8k",
    )
    assert code == 0, err
