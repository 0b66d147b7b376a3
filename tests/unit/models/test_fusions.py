"""megatron-core's fused paths as recipe settings (`<role>.megatron`): each on by default where
the run can take it (CUDA and the package it needs), off on CPU, and asked for where it cannot
run refused at validation naming the key; the engine hands the resolved flags to megatron's
TransformerConfig and DistributedDataParallelConfig."""

import types

import pytest
import torch

import rl3d.models.fusions as fusions
from rl3d.config import ActorConfig, ModelConfig, OptimConfig, load_config
from rl3d.config.errors import ConfigError
from rl3d.config.megatron import MegatronConfig
from rl3d.engine import MegatronEngine
from rl3d.engine.techniques import Fusions
from rl3d.models.spec import get_model_spec

GRPO, PPO = "recipes/quickstart_cpu_grpo.yaml", "recipes/quickstart_cpu_ppo.yaml"
CUDA = ["launch.device=cuda"]
ALL_ON = {"apply_rope_fusion": True, "gradient_accumulation_fusion": True, "overlap_grad_reduce": True}


@pytest.fixture
def packages(monkeypatch):
    """Whether Transformer Engine and apex's extension import, as the test says."""
    have = {"te": True, "apex": True}
    monkeypatch.setitem(fusions.NEEDS, "apply_rope_fusion", ("Transformer Engine", lambda: have["te"]))
    monkeypatch.setitem(fusions.NEEDS, "gradient_accumulation_fusion", ("apex", lambda: have["apex"]))
    return have


def _engine(device: str, *, trainable: bool = True):
    return types.SimpleNamespace(
        groups=types.SimpleNamespace(device=torch.device(device)), trainable=trainable
    )


def test_on_by_default_where_cuda_and_the_package_exist(packages):
    feature = Fusions(MegatronConfig())
    assert feature.model_options(_engine("cuda")) == {
        "apply_rope_fusion": True,
        "gradient_accumulation_fusion": True,
    }
    assert feature.ddp_options(_engine("cuda")) == {"overlap_grad_reduce": True}
    assert feature.on == ALL_ON
    assert Fusions(MegatronConfig()).model_options(_engine("cpu")) == {
        "apply_rope_fusion": False, "gradient_accumulation_fusion": False,
    }  # fmt: skip
    packages["te"] = packages["apex"] = False  # CUDA without TE and apex: only the overlap
    feature = Fusions(MegatronConfig())
    feature.model_options(_engine("cuda"))
    assert feature.on == {**ALL_ON, "apply_rope_fusion": False, "gradient_accumulation_fusion": False}


def test_false_turns_off_lora_and_forward_only_roles_take_less(packages):
    off = Fusions(MegatronConfig(overlap_grad_reduce=False, apply_rope_fusion=False))
    off.model_options(_engine("cuda"))
    assert off.on == {**ALL_ON, "overlap_grad_reduce": False, "apply_rope_fusion": False}
    lora = Fusions(MegatronConfig(), frozen_weights=True)  # the base has no main_grad
    lora.model_options(_engine("cuda"))
    assert lora.on == {**ALL_ON, "gradient_accumulation_fusion": False}
    forward = Fusions(MegatronConfig())
    assert forward.model_options(_engine("cuda", trainable=False))["gradient_accumulation_fusion"] is False
    assert forward.on == {**ALL_ON, "gradient_accumulation_fusion": False, "overlap_grad_reduce": False}
    with pytest.raises(
        ValueError, match="actor.megatron.gradient_accumulation_fusion: true needs every linear"
    ):
        Fusions(MegatronConfig(gradient_accumulation_fusion=True), frozen_weights=True).model_options(
            _engine("cuda")
        )


@pytest.mark.parametrize(
    ("recipe", "setting", "overrides", "reason"),
    [
        (GRPO, "actor.megatron.apply_rope_fusion", [], "needs CUDA"),
        (PPO, "critic.megatron.gradient_accumulation_fusion", [], "needs CUDA"),
        (GRPO, "actor.megatron.apply_rope_fusion", CUDA, "needs Transformer Engine"),
        (GRPO, "actor.megatron.gradient_accumulation_fusion", CUDA, "needs apex"),
        (
            GRPO,
            "actor.megatron.gradient_accumulation_fusion",
            [*CUDA, "actor.lora.rank=4"],
            "needs every linear's weight trained",
        ),
    ],
)
def test_asked_for_where_it_cannot_run_is_refused_naming_the_key(
    packages, recipe, setting, overrides, reason
):
    packages["te"] = packages["apex"] = "linear" in reason  # only LoRA's refusal has both packages
    with pytest.raises(ConfigError, match=f"{setting}: true {reason}"):
        load_config(recipe, [*overrides, f"{setting}=true"])


def test_asked_for_where_it_runs_loads(packages):
    cfg = load_config(GRPO, [*CUDA, "actor.megatron.apply_rope_fusion=true"]).config
    assert cfg.actor.megatron.apply_rope_fusion is True and cfg.actor.megatron.overlap_grad_reduce is None
    # the overlapped reduction runs on gloo too: asked for on CPU it is on; by default, off
    cpu = load_config(GRPO, ["actor.megatron.overlap_grad_reduce=true"]).config
    feature = Fusions(cpu.actor.megatron)
    feature.model_options(_engine("cpu"))
    assert feature.ddp_options(_engine("cpu")) == {"overlap_grad_reduce": True}
    with pytest.raises(ConfigError, match="actor.megatron.overlap_grad_reduce: expected true or false"):
        load_config(GRPO, ["actor.megatron.overlap_grad_reduce=fast"])


def test_the_engine_hands_the_flags_to_megatron(groups_1x1, monkeypatch):
    """On CPU everything stays unfused; what the feature resolves reaches megatron's
    TransformerConfig and the DDP config."""
    import rl3d.models.training as training

    seen = {}
    wrap_ddp = training.wrap_ddp

    def recorded(model, groups, **kwargs):
        seen.update(kwargs)
        return wrap_ddp(model, groups, **kwargs)

    monkeypatch.setattr(training, "wrap_ddp", recorded)
    spec = get_model_spec("tiny-llama")
    engine = MegatronEngine.from_config(
        spec, groups_1x1, role="actor", model=ModelConfig(name=spec.name, dtype="float32"), seed=3,
        batching=ActorConfig(), optim=OptimConfig(lr=1e-3),
    )  # fmt: skip
    config = engine.model.config
    assert (config.apply_rope_fusion, config.gradient_accumulation_fusion) == (False, False)
    assert seen["overlap_grad_reduce"] is False and engine.ddp.ddp_config.overlap_grad_reduce is False
