"""The real SmolLM2-135M-Instruct on gloo: rl3d's actor log-probs at tp 3 (9 heads, 3 KV heads:
one KV head per rank; vocab 49152 split three ways) and pp 2 (15 layers a stage) equal
transformers' on the same chat-formatted tokens within 1e-4 (fp32)."""

import pytest
import torch

from rl3d.testing.real_model import actor_logprobs, chat_prompt_ids, sequence_batch, transformers_logprobs
from rl3d.testing.spawn import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

LOGPROB_TOL = 1e-4
RESPONSES = (
    "12 + 7 = 19.<|im_end|>",
    "The capital of France is Paris.<|im_end|>",
    "def square(x):\n    return x * x",
    "1. Keep a schedule.",
)


def worker(rank, world, layout_pdt, hf_dir, prompts, responses):
    from rl3d.models.bootstrap import destroy_megatron, init_megatron
    from rl3d.parallel.layout import ParallelLayout

    groups = init_megatron(ParallelLayout(*layout_pdt), seed=1)
    batch = sequence_batch(prompts, responses, pad_id=2)
    logp = actor_logprobs(groups, hf_dir, batch, micro_batch_size=2)  # pp 2: two micro-batches
    destroy_megatron()
    return logp


@pytest.fixture(scope="module")
def tokens_and_reference(smollm2_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir, local_files_only=True)
    prompts = chat_prompt_ids(smollm2_dir)[:4]
    responses = [tokenizer.encode(t, add_special_tokens=False) for t in RESPONSES]
    mask = sequence_batch(prompts, responses, pad_id=2)["response_mask"].bool()
    return prompts, responses, mask, transformers_logprobs(smollm2_dir, prompts, responses)


@pytest.mark.parametrize("layout_pdt", [(1, 3, 1), (2, 1, 1)], ids=["tp3", "pp2"])
def test_actor_logprobs_equal_transformers(smollm2_dir, tokens_and_reference, layout_pdt):
    prompts, responses, mask, theirs = tokens_and_reference
    p, t, _ = layout_pdt
    results = run_distributed(worker, p * t, layout_pdt, str(smollm2_dir), prompts, responses, timeout_s=600)
    last_stage = [r for r in results if r is not None]
    assert len(last_stage) == t  # every TP rank of the last stage has the full log-probs
    for ours in last_stage:
        diff = (ours - theirs)[mask].abs().max().item()
        print(
            f"rl3d actor {layout_pdt} vs transformers: max |diff| = {diff:.3g} over {int(mask.sum())} tokens"
        )
        assert diff <= LOGPROB_TOL, diff
    assert torch.equal(last_stage[0], last_stage[-1])
