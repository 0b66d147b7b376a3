"""`rl3d train` on the real SmolLM2-135M-Instruct (`model.hf_path: smollm2-135m`), fp32, on one
CPU rank and on three (training tp 3, generation t_g 1): the torch engine's log-probs of its
samples equal the trainer's (`rollout/logp_diff_max` <= 1e-3), and after training at lr 1e-30
`rl3d export` gives back the input (tied embeddings: one `model.embed_tokens.weight`, no
`lm_head.weight`): every nonzero weight bit for bit. The dequantized Q4_1 checkpoint holds exact
zeros, and an Adam step of lr 1e-30 does move a zero (to about +-1e-30 a step): those come back
within ZERO_DRIFT. The reward (words in the response) varies within a group, so the gradient is
not zero and the round trip is not vacuous."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file
from test_hf_export import export
from train_helpers import metrics_by_step, run_train

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

LOGP_DIFF_MAX = 1e-3
LR, STEPS = 1e-30, 2
ZERO_DRIFT = 4 * LR * STEPS  # Adam's step is at most a few lr early on (bias-corrected m / sqrt(v))
QUESTIONS = {"What is 12 + 7?": "19", "What is 3 + 5?": "8", "What is 9 - 4?": "5", "What is 6 * 2?": "12"}
# The chat frame of SmolLM2's template around a plain-text prompt column.
CHAT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\n{prompt} End with '#### <answer>'.<|im_end|>\n<|im_start|>assistant\n"
)
RECIPE = """\
defaults:
  - models/smollm2_135m
  - algos/grpo
  - rollout/torch_cpu
  - clusters/local_cpu
actor:
  parallel: {tp: 1, pp: 1, dp: 1}
  optim: {lr: 1.0e-30}
  mini_batch_size: 4
  micro_batch_size: 4
  recompute_old_logp: always  # the trainer's log-probs of the samples, to compare with the engine's
rollout: {n: 2, max_new_tokens: 8, stop_token_ids: [2]}
reward: {fn: "user_rewards:count_words"}
trainer: {total_steps: 2, seed: 1, experiment: real_model_e2e}
checkpoint: {save_every: 2}
launch: {nproc_per_node: 1}
"""


def assert_round_trip(out_dir, src_dir):
    """Nonzero weights equal bit for bit; weights that are exactly 0 in the input within ZERO_DRIFT."""
    out, src = load_file(out_dir / "model.safetensors"), load_file(src_dir / "model.safetensors")
    assert sorted(out) == sorted(src)
    zeros = moved = 0
    for key in src:
        a, b = out[key], src[key]
        assert a.dtype == b.dtype and a.shape == b.shape, key
        zero = b == 0
        assert torch.equal(a[~zero], b[~zero]), key
        if zero.any():
            assert a[zero].abs().max().item() <= ZERO_DRIFT, key
        zeros, moved = zeros + int(zero.sum()), moved + int((a[zero] != 0).sum())
    print(f"export: nonzero weights bit for bit; {moved} of {zeros} exact zeros moved, <= {ZERO_DRIFT}")


@pytest.mark.parametrize(
    "layout",
    [
        ("actor.parallel.tp=1", "launch.nproc_per_node=1", "data.prompts_per_step=2"),
        # training tp 3 -> generation t_g 1: a micro-DP reshard of the real weights (3 KV heads)
        # and three generation-DP ranks, then the export gathers the three TP shards
        ("actor.parallel.tp=3", "rollout.t_g=1", "launch.nproc_per_node=3", "data.prompts_per_step=3",
         "actor.mini_batch_size=6", "actor.micro_batch_size=6"),
    ],
    ids=["tp1", "tp3-tg1"],
)  # fmt: skip
def test_rollout_logprobs_and_export_round_trip(smollm2_dir, tmp_path, layout):
    data = tmp_path / "train.parquet"
    pq.write_table(pa.table({"prompt": list(QUESTIONS), "answer": list(QUESTIONS.values())}), data)
    recipe = tmp_path / "real.yaml"
    recipe.write_text(RECIPE)
    run_dir = tmp_path / "run"
    proc = run_train(
        recipe,
        run_dir,
        f"data.train_files=[{data}]",
        f"data.template={json.dumps(CHAT)}",
        "data.max_prompt_length=64",
        *layout,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = metrics_by_step(run_dir)
    assert sorted(metrics) == [1, 2]
    for step, row in metrics.items():
        print(f"step {step}: rollout/logp_diff_max = {row['rollout/logp_diff_max']:.3g}")
        assert row["rollout/logp_diff_max"] <= LOGP_DIFF_MAX, (step, row["rollout/logp_diff_max"])
        assert row["actor/grad_norm"] > 0, (step, row["actor/grad_norm"])
    out = export(run_dir, tmp_path / "export")
    assert_round_trip(out, smollm2_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert (out / name).read_bytes() == (smollm2_dir / name).read_bytes(), name
