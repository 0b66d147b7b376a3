"""Packing on a CUDA device without Transformer Engine is refused where a role is built, naming
the section's `packing` key: megatron's local attention would take a packed row's [N, N]
block-causal mask and keep N x N fp32 scores per head and layer. CI has no GPU, and needs none:
the refusal comes before anything touches the device, so a real 1-1-1 grid whose `device` says
cuda (`torch.device("cuda")` is made without a GPU) goes through the real call sites, with the
transformer_engine import made to fail."""

import dataclasses
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rl3d.config import ActorConfig, ModelConfig
from rl3d.engine import MegatronEngine
from rl3d.models.builder import NeedsTransformerEngine, use_transformer_engine
from rl3d.models.spec import get_model_spec
from rl3d.workers.reward_model import load_reward_model

SPEC = get_model_spec("tiny-llama")
MODEL = ModelConfig(name="tiny-llama", dtype="float32")


@pytest.fixture
def cuda_without_te(groups_1x1, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformer_engine", None)  # `import transformer_engine` fails
    return dataclasses.replace(groups_1x1, device=torch.device("cuda"))


def test_a_packing_role_on_cuda_without_te_is_refused_naming_its_key(cuda_without_te):
    with pytest.raises(NeedsTransformerEngine) as refused:
        MegatronEngine.from_config(
            SPEC, cuda_without_te, role="actor", model=MODEL, seed=1, batching=ActorConfig(packing=True)
        )
    message = str(refused.value)
    assert message.startswith("actor.packing: true on a CUDA device needs Transformer Engine")
    assert "quadratic in N" in message  # why
    assert "make install-gpu" in message and message.endswith("set actor.packing: false")  # what to do
    assert refused.value.key == "actor.packing"


def test_a_reward_model_names_its_own_section(cuda_without_te):
    section = SimpleNamespace(packing=True, max_tokens_per_micro_batch=None)
    with pytest.raises(NeedsTransformerEngine, match=r"^reward\.cost_model\.packing: true"):
        load_reward_model(
            SPEC,
            cuda_without_te,
            Path("unread"),
            model=MODEL,
            seed=1,
            batching=section,
            key="reward.cost_model",
        )


def test_the_decision_reads_device_type_and_te():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert use_transformer_engine(cuda, packed=True, transformer_engine=True)
    assert not use_transformer_engine(cpu, packed=True, transformer_engine=False)  # CPU: local spec, any N
    assert not use_transformer_engine(cuda, transformer_engine=False)  # padded: local spec, no N x N row
    with pytest.raises(NeedsTransformerEngine, match=r"^critic\.packing: "):
        use_transformer_engine(cuda, packed=True, key="critic.packing", transformer_engine=False)
