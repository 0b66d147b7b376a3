"""Chat-format data end to end (real torchrun, the GRPO quickstart at tp=2 on a tiny model with
a 32-id vocabulary, so its random policy samples the end id often): a verl-layout parquet with
a bad row, loaded with `data.train_files` alone, framed by a chat template with a system prompt,
generation stopped at the tokenizer's end id, samples.jsonl naming the finish."""

import json

import pytest
from train_helpers import GRPO, metrics_by_step, run_train

from rl3d.testing.chat import save_chat_tokenizer, verl_row, write_verl_parquet

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_verl_parquet_with_chat_template_and_eos(tmp_path):
    questions = [f"what is {a} plus {b} ?" for a in ("two", "three") for b in ("two", "three", "?")]
    rows = [verl_row(q, str(i), i) for i, q in enumerate(questions)]
    rows[2]["prompt"] = [{"role": "human", "content": "what is two ?"}]  # a bad row, skipped
    data = write_verl_parquet(tmp_path / "train.parquet", rows)
    words = ["system", "user", "assistant", "what", "is", "two", "plus", "three", "?"]
    tok = save_chat_tokenizer(tmp_path / "tok", words)  # 4 specials + 9 words + 10 digits < 32
    run_dir = tmp_path / "run"
    proc = run_train(
        GRPO,
        run_dir,
        f"data.train_files=[{data}]",
        f"data.tokenizer={tok}",
        "data.system_prompt=two",
        "model.name=tiny-llama-v32",
        "data.max_prompt_length=40",
        "data.prompts_per_step=4",
        "rollout.max_new_tokens=16",
        "reward.fn=gsm8k",
        "trainer.total_steps=3",
        "checkpoint.save_every=0",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = (run_dir / "logs/rank0.log").read_text()
    assert f"skipping bad row {data}:2: column 'prompt': message 0 has role 'human'" in log
    assert "loaded 5 prompts from 1 file(s), skipped 1 bad rows" in log
    steps = metrics_by_step(run_dir)
    assert sorted(steps) == [1, 2, 3]
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 12
    for s in samples:
        assert s["prompt"].startswith("<|im_start|>system\ntwo<|im_end|>\n<|im_start|>user\nwhat is ")
        assert s["prompt"].endswith("<|im_start|>assistant\n")
        tokens = s["response"].split()
        # the end id ends a response and nothing follows it; otherwise it ran to max_new_tokens
        assert "<|im_end|>" not in tokens[:-1], s
        if s["finish_reason"] == "eos":
            assert tokens[-1] == "<|im_end|>" and s["num_tokens"] <= 16
        else:
            assert s["finish_reason"] == "length" and s["num_tokens"] == 16
    assert any(s["finish_reason"] == "eos" for s in samples)
    assert any(r["response/stop_fraction"] > 0 for r in steps.values())
