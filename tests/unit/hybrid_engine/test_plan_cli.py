"""`rl3d plan`: the JSON contract other tools read, the human table, --auto, and errors."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rl3d.cli import EXIT_BAD_INPUT, main

ROOT = Path(__file__).resolve().parents[3]
STRATEGY_FIELDS = {
    "strategy",
    "comm_bytes_max",
    "comm_bytes_mean",
    "peak_param_bytes",
    "redundant_bytes",
    "d_g",
}


def run_json(capsys, *args):
    assert main(["plan", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_contract_for_70b(capsys):
    out = run_json(capsys, "--model", "llama2-70b", "--train", "4,8,4", "--gen", "8,1")
    assert set(out["strategies"]) == {"hybridflow", "hybridflow_v", "ds_chat", "openrlhf", "hybridflow_hier"}
    for name, s in out["strategies"].items():
        assert STRATEGY_FIELDS <= set(s) and s["strategy"] == name and s["d_g"] == 4
    hf, ds = out["strategies"]["hybridflow"], out["strategies"]["ds_chat"]
    assert hf["comm_bytes_max"] < ds["comm_bytes_max"] and hf["redundant_bytes"] == 0
    assert out["d_g"] == 4 and out["world_size"] == 128


def test_strategy_filter_and_dtype(capsys):
    bf16 = run_json(
        capsys, "--model", "llama3-8b", "--train", "1,4,2", "--gen", "2,1", "--strategy", "hybridflow"
    )
    fp32 = run_json(
        capsys,
        "--model",
        "llama3-8b",
        "--train",
        "1,4,2",
        "--gen",
        "2,1",
        "--strategy",
        "hybridflow",
        "--dtype",
        "float32",
    )
    assert list(bf16["strategies"]) == ["hybridflow"]
    assert (
        fp32["strategies"]["hybridflow"]["comm_bytes_max"]
        == 2 * bf16["strategies"]["hybridflow"]["comm_bytes_max"]
    )


def test_plan_from_recipe(capsys):
    out = run_json(capsys, str(ROOT / "recipes/quickstart_cpu_grpo.yaml"))
    assert out["model"] == "tiny-llama" and out["train"] == {"p": 1, "t": 2, "d": 1} and out["d_g"] == 2


def test_the_push_to_sglang_is_a_step_of_the_plan(capsys):
    """With rollout.engine: sglang the plan ends with the push to the engine, in buckets of
    rollout.sglang.bucket_mb (the table and the JSON); the torch engine's push is empty."""
    from rl3d.hybrid_engine.engine_push import plan_engine_push
    from rl3d.hybrid_engine.params import model_params
    from rl3d.models.spec import get_model_spec

    spec = get_model_spec("tiny-llama")
    want = plan_engine_push(spec, model_params(spec, train_tp=2), 1, dtype="float32", bucket_bytes=104857)
    recipe = str(ROOT / "recipes/quickstart_cpu_grpo.yaml")
    sglang = ("rollout.engine=sglang", "launch.device=cuda", "model.hf_path=/hf")
    sglang += ("rollout.sglang.bucket_mb=0.1",)
    assert run_json(capsys, recipe, *sglang)["engine_push"] == want.summary() and len(want.buckets) > 1
    assert run_json(capsys, recipe)["engine_push"] == {
        "bytes": 0, "buckets": 0, "tensors": 0, "bucket_bytes": 0, "gather_bytes": 0,
        "largest_bucket_bytes": 0, "peak_bytes": 0,
    }  # fmt: skip
    flags = ("--model", "tiny-llama", "--train", "1,2,1", "--gen", "1,1", "--dtype", "float32")
    assert run_json(capsys, *flags, "--push-bucket-mb", "0.1")["engine_push"] == want.summary()
    assert main(["plan", recipe, *sglang, "--strategy", "hybridflow"]) == 0
    out = capsys.readouterr().out
    assert (
        "engine push, per generation rank after the transition: 21 HF tensors, 500.992 KB in "
        f"{len(want.buckets)} buckets of <= 104.857 KB (a larger tensor alone; the largest "
        f"{want.largest_bucket_bytes / 1e3:.3f} KB)" in out
    )
    assert f"; {want.peak_bytes / 1e3:.3f} KB held at its peak" in out
    assert main(["plan", recipe, "--strategy", "hybridflow"]) == 0
    assert "engine push" not in capsys.readouterr().out


def test_identity_transition_is_planned_and_shown(capsys):
    """t_g = t, p_g = p: no collective, 0 bytes, each rank's training shard is its generation
    shard, and the table says whether the torch engine then reads it in place."""
    from rl3d.hybrid_engine.plan import plan_transition
    from rl3d.models.spec import get_model_spec
    from rl3d.parallel import ParallelLayout

    plan = plan_transition(
        get_model_spec("tiny-llama"), ParallelLayout(2, 2, 2), 2, 2, strategies=("hybridflow",)
    )
    hf = plan.strategies["hybridflow"]
    assert hf.collectives == [] and hf.comm_bytes_max == 0 and hf.redundant_bytes == 0
    assert all(r.peak_param_bytes == plan.rank_bytes(r.rank)[0] for r in hf.ranks)  # the training shard
    recipe = str(ROOT / "recipes/quickstart_cpu_grpo.yaml")
    out = run_json(capsys, recipe, "rollout.t_g=2", "--strategy", "hybridflow")
    assert out["identity"] is True and out["strategies"]["hybridflow"]["comm_bytes_max"] == 0
    assert run_json(capsys, recipe, "--strategy", "hybridflow")["identity"] is False  # t_g = 1 < t = 2

    def text(*overrides):
        assert main(["plan", recipe, "rollout.t_g=2", *overrides, "--strategy", "hybridflow"]) == 0
        return capsys.readouterr().out

    assert "reads the training parameters in place (0 bytes copied)" in text()
    assert "rollout.dtype=bfloat16 makes the torch engine hold a cast copy" in text("rollout.dtype=bfloat16")
    assert "identity" not in text("rollout.t_g=1")


def test_human_table_summarises_big_worlds(capsys):
    assert main(["plan", "--model", "llama2-70b", "--train", "4,8,4", "--gen", "8,1"]) == 0
    out = capsys.readouterr().out
    assert "micro-DP           [0, 32, 64, 96]" in out and "(32 groups of 4)" in out
    assert "hybridflow" in out and "vs ds_chat" in out


def test_auto_marks_fastest_fitting_layout(capsys):
    assert main(["plan", "--model", "llama2-70b", "--train", "4,8,4", "--auto", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["layouts"]
    assert len(rows) == 4 * 3  # t_g in {1,2,4,8} x p_g in {1,2,4}
    best = [r for r in rows if r["best"]]
    assert len(best) == 1 and best[0]["fits"]
    assert best[0]["total_s"] == min(r["total_s"] for r in rows if r["fits"])
    t1 = next(r for r in rows if r["t_g"] == 1 and r["p_g"] == 1)
    assert not t1["fits"]  # a whole 70B model does not fit in 80 GB with its KV cache


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "llama2-70b", "--train", "4,8", "--gen", "8,1"], "--train expects 3"),
        (["--model", "llama2-70b", "--train", "4,8,4", "--gen", "3,1"], "t_g=3 must divide training t=8"),
        (
            ["--model", "llama2-71b", "--train", "4,8,4", "--gen", "8,1"],
            "unknown model 'llama2-71b' (did you mean",
        ),
        (["--model", "llama2-70b"], "give a RECIPE"),
    ],
)
def test_bad_input_exits_2_with_reason(args, message, capsys):
    assert main(["plan", *args]) == EXIT_BAD_INPUT
    assert message in capsys.readouterr().err


def test_70b_plan_is_fast_and_never_imports_torch():
    """`rl3d plan` is pure Python over shapes, the push to SGLang included: no torch import, so
    no tensor memory at all."""
    code = (
        "import sys, time; t = time.perf_counter(); from rl3d.cli import main; "
        "main(['plan', '--model', 'llama2-70b', '--train', '4,8,4', '--gen', '8,1', '--json', "
        "'--push-bucket-mb', '512']); "
        "print(time.perf_counter() - t); print('torch' in sys.modules)"
    )
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    wall = time.perf_counter() - start
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[-1] == "False"
    assert float(lines[-2]) < 2.0, f"planning took {lines[-2]} s (process wall {wall:.2f} s)"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--train", "1,1,100000000", "--gen", "1,1"], "--train: 100000000 ranks; rl3d plan handles at most"),
        (["--train", "1,8,2", "--auto", "--gpu-mem-gb", "-5"], "--gpu-mem-gb must be > 0, got -5"),
        (["--train", "1,8,2", "--auto", "--batch", "0"], "--batch must be > 0, got 0"),
        (["--train", "1,8,2", "--gen", "8,1", "--response-len", "0"], "--response-len must be >= 1, got 0"),
        (["--train", "1,8,2", "--gen", "8,1", "--push-bucket-mb", "0"], "--push-bucket-mb must be > 0"),
        (["--train", "2,8,2", "--gen", "8,2", "--push-bucket-mb", "1"], "p_g=2: an engine that takes whole"),
    ],
)
def test_inputs_a_plan_cannot_mean_are_refused_at_once(capsys, args, message):
    start = time.monotonic()
    assert main(["plan", "--model", "llama2-70b", *args]) == EXIT_BAD_INPUT
    assert message in capsys.readouterr().err and time.monotonic() - start < 5
