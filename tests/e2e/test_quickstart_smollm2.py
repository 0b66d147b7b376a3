"""The real-model quickstart end to end: SmolLM2-135M-Instruct, rl3d's GSM8K-style problems in
verl's layout through the chat template, EOS stops, the GSM8K scorer by data source."""

import json
import math

import pytest
from train_helpers import ROOT, metrics_by_step, run_train

from rl3d.data.gsm8k_synth import write_splits

SMOLLM2_GSM8K = ROOT / "recipes/quickstart_cpu_smollm2_gsm8k.yaml"


@pytest.mark.slow
def test_the_smollm2_quickstart_trains_a_few_steps(tmp_path, smollm2_dir):
    train, val = write_splits(
        tmp_path / "data",
        num_train=64,
        num_val=8,
        seed=0,
        steps=1,
        max_number=5,
        ops=("add",),
        instruction="",
    )
    run_dir = tmp_path / "run"
    proc = run_train(
        SMOLLM2_GSM8K,
        run_dir,
        f"model.hf_path={smollm2_dir}",
        f"data.train_files=[{train}]",
        f"data.val_files=[{val}]",
        "data.prompts_per_step=2",
        "actor.mini_batch_size=16",
        "trainer.total_steps=2",
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = metrics_by_step(run_dir)
    assert sorted(rows) == [1, 2]
    for r in rows.values():
        assert 0.0 <= r["gsm8k/exact"] <= r["gsm8k/format"] <= 1.0
        assert r["reward/score_mean"] == pytest.approx(
            r["gsm8k/exact"] + 0.1 * (r["gsm8k/format"] - r["gsm8k/exact"])
        )
        assert math.isfinite(r["actor/pg_loss"]) and r["actor/grad_norm"] > 0  # the real weights train
        assert r["response/length_max"] <= 20
    assert any(r["response/stop_fraction"] > 0 for r in rows.values())  # the chat model's EOS ends answers
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert samples and samples[0]["prompt"].startswith("<|im_start|>system\nGive the calculation")
    assert {s["finish_reason"] for s in samples} <= {"eos", "length"}
