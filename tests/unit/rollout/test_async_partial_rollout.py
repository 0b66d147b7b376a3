"""Partial rollouts on the torch engine: `before_forward(step)` is called before every forward
that makes a token's logits (0: the prefill), and weights it loads there are used from that
token on. Tokens before the swap equal a generation on the old weights, tokens from the swap
on differ, and without a hook nothing changes."""

import torch

from rl3d.hybrid_engine.weights import full_model
from rl3d.models.params import model_params
from rl3d.models.spec import get_model_spec
from rl3d.rollout import SamplingParams
from rl3d.rollout.torch_engine import TorchRolloutEngine

SPEC = get_model_spec("tiny-llama")
PROMPTS = [[5, 6, 7], [9, 10]]
PARAMS = SamplingParams(temperature=0.0, max_new_tokens=12, n=1, seed=3)


def weights(seed):
    return full_model(model_params(SPEC, train_tp=1), seed=seed, dtype=torch.float32)


def generate(w, hook=None):
    engine = TorchRolloutEngine(SPEC, w)
    engine.before_forward = None if hook is None else (lambda step: hook(engine, step))
    return engine.generate(PROMPTS, PARAMS)


def test_weights_swapped_mid_generation_are_used_from_that_token_on():
    old, new = weights(1), weights(2)
    steps = []

    def swap_at_5(engine, step):
        steps.append(step)
        if step == 5:
            engine.load_weights(new)

    mixed = generate(old, swap_at_5)
    plain_old = generate(old)
    assert steps == list(range(PARAMS.max_new_tokens))  # prefill + every decode forward
    assert torch.equal(mixed.response_ids[:, :5], plain_old.response_ids[:, :5])
    assert torch.equal(mixed.raw_logprobs[:, :5], plain_old.raw_logprobs[:, :5])
    assert not torch.equal(mixed.raw_logprobs[:, 5:], plain_old.raw_logprobs[:, 5:])


def test_a_hook_that_loads_nothing_changes_nothing():
    w = weights(1)
    a, b = generate(w), generate(w, lambda engine, step: None)
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.raw_logprobs, b.raw_logprobs)
