"""`SamplingParams.top_logprobs`: the torch engine returns each generated token's most likely
alternatives under the plain softmax, from the logits it sampled from (no extra forward). They
equal the top k of HF transformers' log_softmax on the same ids within 1e-5 (the random models
of test_rollout_torch_engine, whose distributions are far from uniform)."""

import pytest
import torch
from test_rollout_torch_engine import LOGPROB_TOL, PROMPTS, hf_reference, megatron_model

from rl3d.rollout import SamplingParams, TorchRolloutEngine

K = 5


FILTERED = SamplingParams(max_new_tokens=8, temperature=0.7, top_p=0.9, seed=1, top_logprobs=K)


@pytest.mark.parametrize(
    "name, params",
    [
        ("tiny-llama", SamplingParams(max_new_tokens=8, n=2, seed=3, top_logprobs=K)),
        ("tiny-llama-odd-vocab", FILTERED),
    ],
)
def test_top_logprobs_are_the_models_top_k(name, params):
    spec, _, full = megatron_model(name)
    batch = TorchRolloutEngine(spec, full).generate(PROMPTS, params)
    model = hf_reference(spec, full)
    tops, raws, worst, hits = batch.token_top(), batch.token_logprobs(raw=True), 0.0, 0
    for row, resp in enumerate(batch.responses()):
        prompt = PROMPTS[int(batch.prompt_index[row])]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + resp])).logits[0, len(prompt) - 1 : -1].float()
        ref_lp, ref_ids = torch.log_softmax(logits, -1).topk(K, -1)
        assert len(tops[row]) == len(resp)
        for step, (token, raw, alts) in enumerate(zip(resp, raws[row], tops[row])):
            ids, lps = [a for a, _ in alts], [lp for _, lp in alts]
            assert ids == ref_ids[step].tolist() and lps == sorted(lps, reverse=True)
            assert all(0 <= t < spec.vocab_size for t in ids)  # never a vocab-padding column
            worst = max(worst, (torch.tensor(lps) - ref_lp[step]).abs().max().item())
            if token in ids:  # the sampled token among them carries its very log-prob
                assert lps[ids.index(token)] == raw
                hits += 1
    assert worst <= LOGPROB_TOL, worst
    assert hits > 0


def test_no_top_logprobs_unless_asked():
    spec, _, full = megatron_model("tiny-llama")
    batch = TorchRolloutEngine(spec, full).generate(PROMPTS[:1], SamplingParams(max_new_tokens=3, seed=1))
    assert batch.top_ids is None and batch.token_top() is None
    with pytest.raises(ValueError, match="top_logprobs"):
        SamplingParams(top_logprobs=-1)
