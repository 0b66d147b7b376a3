"""The real SmolLM2-135M-Instruct: rl3d's actor log-probs (tp 1, one process, fp32) equal
transformers' on the same chat-formatted tokens within 1e-4. The tp 3 and pp 2 layouts are in
tests/distributed/models/test_models_real_dist.py."""

from rl3d.testing.real_model import (
    actor_logprobs,
    chat_prompt_ids,
    sequence_batch,
    transformers_logprobs,
)

LOGPROB_TOL = 1e-4  # fp32, 30 layers; the observed difference is printed
RESPONSES = ("12 + 7 = 19.<|im_end|>", "The capital of France is Paris.<|im_end|>", "Hello")


def response_ids(hf_dir, texts=RESPONSES):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]


def test_actor_logprobs_equal_transformers_at_tp1(smollm2_dir, groups_1x1, one_torch_thread):
    # prompts of different lengths, so the batch holds left padding and right padding
    prompts = chat_prompt_ids(smollm2_dir)[:2] + [chat_prompt_ids(smollm2_dir)[6]]
    responses = response_ids(smollm2_dir)
    batch = sequence_batch(prompts, responses, pad_id=2)
    ours = actor_logprobs(groups_1x1, smollm2_dir, batch)
    theirs = transformers_logprobs(smollm2_dir, prompts, responses)
    mask = batch["response_mask"].bool()
    diff = (ours - theirs)[mask].abs().max().item()
    print(
        f"rl3d actor (tp1) vs transformers log-probs: max |diff| = {diff:.3g} over {int(mask.sum())} tokens"
    )
    assert diff <= LOGPROB_TOL, diff
    assert theirs[mask].min() < -1.0  # real distributions, not all-certain tokens
