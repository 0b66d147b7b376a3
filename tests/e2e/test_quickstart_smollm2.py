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
        # the format credit: two steps of the strict reward may all score 0 (no gradient)
        "reward.fn_by_source={rl3d/gsm8k_synth: gsm8k_format_credit}",
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = metrics_by_step(run_dir)
    assert sorted(rows) == [1, 2]
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    for step, r in rows.items():
        answers = [s for s in samples if s["step"] == step and s["split"] == "train"]
        assert len(answers) == 16  # every response of the step: 2 prompts x 8
        assert {round(s["reward"], 6) for s in answers} <= {0.0, 0.1, 1.0}
        assert r["reward/score_mean"] == pytest.approx(sum(s["reward"] for s in answers) / 16)
        assert math.isfinite(r["actor/pg_loss"])
        assert r["response/length_max"] <= 20
    assert any(r["actor/grad_norm"] > 0 for r in rows.values())  # the real weights train
    assert any(r["response/stop_fraction"] > 0 for r in rows.values())  # the chat model's EOS ends answers
    assert samples[0]["prompt"].startswith("<|im_start|>system\nGive the calculation")
    assert {s["finish_reason"] for s in samples} <= {"eos", "length"}
