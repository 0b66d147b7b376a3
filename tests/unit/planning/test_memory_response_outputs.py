"""The memory plan counts a role's logits where its engine computes them: both read
`rl3d.engine.micro_batches.response_outputs`, so flipping the setting moves the plan and the
engine together (the response positions alone, or the whole sequence)."""

from types import SimpleNamespace

import pytest

from rl3d.config import load_config
from rl3d.engine import Features
from rl3d.engine import micro_batches as mb
from rl3d.models.spec import spec_of
from rl3d.parallel import ParallelLayout
from rl3d.parallel.sharding import padded_vocab_size
from rl3d.planning import plan_memory
from rl3d.utils.dtypes import DTYPE_BYTES

PPO_RM = "recipes/quickstart_cpu_ppo_rm.yaml"  # actor, critic, reference, reward model at tp 2
ROLES = ("actor", "critic", "reference", "reward_model")


def _activations(cfg) -> dict[str, int]:
    return {role: plan_memory(cfg).ranks[0].phases["train"][role].activations for role in ROLES}


def _engine_flag(role: str) -> bool:
    groups = SimpleNamespace(layout=ParallelLayout(1, 1, 1))
    return mb.MicroBatches(None, groups, role=role, features=Features([])).response_outputs


def test_flipping_response_outputs_moves_the_plan_with_the_engine(monkeypatch):
    cfg = load_config(PPO_RM).config
    on = _activations(cfg)
    assert {role: _engine_flag(role) for role in ROLES} == {
        "actor": True,
        "critic": False,
        "reference": True,
        "reward_model": False,
    }
    monkeypatch.setattr(mb, "RESPONSE_ONLY_ROLES", ())
    off = _activations(cfg)
    assert not any(_engine_flag(role) for role in ROLES)

    spec, tp = spec_of(cfg.model), cfg.actor.parallel.tp
    R = cfg.rollout.max_new_tokens
    s = cfg.data.max_prompt_length + R
    vocab = padded_vocab_size(spec.vocab_size, tp) // tp
    B = DTYPE_BYTES[cfg.model.dtype]
    for role in ("critic", "reward_model"):  # value heads: the setting is not theirs
        assert off[role] == on[role], role
    # the output layer's logits over all s positions instead of R, for the one micro-batch each
    # holds (pp 1: one in flight)
    grown = (s - R) * cfg.actor.micro_batch_size * vocab * B
    assert grown > 0
    assert off["reference"] - on["reference"] == grown
    assert off["actor"] - on["actor"] == grown


@pytest.mark.parametrize("role", ["actor", "reference"])
def test_the_engine_reads_the_same_setting(monkeypatch, role):
    assert _engine_flag(role) is mb.response_outputs(role) is True
    monkeypatch.setattr(mb, "RESPONSE_ONLY_ROLES", tuple(r for r in mb.RESPONSE_ONLY_ROLES if r != role))
    assert _engine_flag(role) is mb.response_outputs(role) is False
