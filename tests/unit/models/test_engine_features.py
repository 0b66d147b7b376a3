"""The engine's model techniques as features: one table builds them from a role's recipe section,
in its order; each reaches the model through its hooks (megatron settings, attach, the update's
metrics, the memory plan's footprint), and a section that leaves a technique off gets none of it."""

import dataclasses

import pytest
import torch

from rl3d.config import ActorConfig, CriticConfig, ModelConfig, OptimConfig
from rl3d.config.lora import LoraConfig
from rl3d.config.moe import MoeConfig
from rl3d.config.parallel import ParallelConfig
from rl3d.costs.micro_batch import MicroBatchShape
from rl3d.engine import Feature, Features, FeatureSource, Footprint, MegatronEngine
from rl3d.engine.techniques import (
    TECHNIQUES,
    Lora,
    MoE,
    Offload,
    Packing,
    Recompute,
    RoutingReplay,
    SequenceParallel,
    features_from,
)
from rl3d.models.builder import NeedsTransformerEngine
from rl3d.models.spec import get_model_spec
from rl3d.single_controller.batch import DataBatch

DENSE, MOE = get_model_spec("tiny-llama"), get_model_spec("tiny-qwen3-moe")


def names(features: Features) -> list[str]:
    return [f.name for f in features.items]


def test_a_section_turns_on_exactly_its_techniques_in_table_order():
    section = ActorConfig(
        packing=True,
        max_tokens_per_micro_batch=64,
        recompute="full",
        offload=["grads", "optimizer"],
        parallel=ParallelConfig(tp=2, sequence_parallel=True),
        moe=MoeConfig(aux_loss_coef=0.01),
    )
    lora = LoraConfig(rank=4, alpha=8)
    every = features_from(FeatureSource("actor", section, MOE, 2, lora=lora, routing_replay=True))
    assert names(every) == [t.name for t in TECHNIQUES]  # all eight, in the table's order
    assert every.get(MoE).overrides == {"moe_aux_loss_coeff": 0.01}
    # a trained role's megatron fusions decide on its device (off on CPU)
    assert names(features_from(FeatureSource("critic", CriticConfig(), DENSE, 1))) == ["fusions"]
    # padded, nothing on but the fusions' defaults (off on CPU)
    assert names(features_from(FeatureSource("reference", None, DENSE, 1))) == ["fusions"]
    # sequence parallelism: auto turns it on for a mixture of experts at tp > 1 only
    assert names(features_from(FeatureSource("critic", CriticConfig(), MOE, 2))) == [
        "sequence_parallel",
        "moe",
        "fusions",
    ]
    assert names(features_from(FeatureSource("critic", CriticConfig(), MOE, 1))) == ["moe", "fusions"]


def test_a_token_budget_without_packing_is_refused_naming_the_key():
    section = CriticConfig(packing=False)
    object.__setattr__(section, "max_tokens_per_micro_batch", 32)  # past the section's own check
    with pytest.raises(ValueError, match="critic.max_tokens_per_micro_batch needs critic.packing: true"):
        features_from(FeatureSource("critic", section, DENSE, 1))


def test_two_features_that_set_one_megatron_setting_differently_are_refused():
    class A(Feature):
        name = "a"

        def model_options(self, engine):
            return {"recompute_granularity": "full"}

    class B(A):
        name = "b"

        def model_options(self, engine):
            return {"recompute_granularity": "selective"}

    assert Features([A()]).model_options(None) == {"recompute_granularity": "full"}
    with pytest.raises(AssertionError, match="b sets \\['recompute_granularity'\\]"):
        Features([A(), B()]).model_options(None)
    with pytest.raises(AssertionError, match="a technique twice"):
        Features([A(), A()])


def _engine(groups, spec, section, *, trained: bool) -> MegatronEngine:
    optim = OptimConfig(lr=1e-3) if trained else None
    return MegatronEngine.from_config(
        spec, groups, role="actor", model=ModelConfig(name=spec.name, dtype="float32"), seed=3,
        batching=section, optim=optim,
    )  # fmt: skip


def test_the_features_reach_the_model_through_their_hooks(groups_1x1):
    section = ActorConfig(recompute="full", moe=MoeConfig(z_loss_coef=0.5))
    trained = _engine(groups_1x1, MOE, section, trained=True)
    config = trained.model.config
    assert (config.recompute_granularity, config.recompute_num_layers) == ("full", 1)  # model_options
    assert config.moe_z_loss_coeff == 0.5  # the router loss trains the router: trained roles
    assert trained.features.get(MoE).load is not None  # attach: the expert-load hooks
    frozen = _engine(groups_1x1, MOE, section, trained=False)
    assert not frozen.model.config.moe_z_loss_coeff and frozen.features.get(MoE).load is None
    plain = _engine(groups_1x1, DENSE, ActorConfig(), trained=True)
    assert plain.model.config.recompute_granularity is None and names(plain.features) == ["fusions"]
    assert (plain.lora, plain.replay, plain.offload, plain.to_host()) == (None, None, None, 0)


def test_a_trained_mixture_of_experts_reports_its_expert_loads_after_an_update(groups_1x1):
    engine = _engine(groups_1x1, MOE, ActorConfig(), trained=True)
    T, R = 12, 4
    ids = torch.randint(0, MOE.vocab_size, (2, T))
    batch = DataBatch(
        {"input_ids": ids, "attention_mask": torch.ones(2, T, dtype=torch.long),
         "response_mask": torch.ones(2, R), "responses": ids[:, T - R:]}
    )  # fmt: skip

    def loss_of(output, micro):
        return output.float().mean(), {}

    rows = engine.train_minibatches(
        batch, mini_batch_size=2, micro_batch_size=1, epochs=1, loss_of=loss_of, count_unit=lambda m: 1.0
    )
    loads = [r for r in rows if any(k.startswith("moe/") for k in r)]
    assert len(loads) == 1, rows  # the MoE feature's after_update, once per update
    # every token of the two sequences routed to top-k experts in each layer, none dropped
    assert loads[0]["moe/dropped_tokens"] == 0.0 and loads[0]["moe/load_max_over_mean"] >= 1.0


def test_each_feature_shapes_the_memory_plan_s_footprint_of_its_role():
    """The footprint hook on a plain role (4 rows of 23 tokens, 8 of them the response, at tp 2
    on CUDA): sequence parallelism pads to a multiple of tp, packing then makes one row of the
    padded sequences (or of its budget, padded too) in the attention the builder would pick."""
    plain = Footprint(MicroBatchShape(23, 4, 8, flash=False), tp=2, cuda=True)
    assert Features().footprint(plain) == plain  # no technique: the plain role
    split = Features([SequenceParallel()]).footprint(plain).batch
    assert (split.seq_len, split.rows, split.sequence_parallel) == (24, 4, True)
    packed = Features([SequenceParallel(), Packing()]).footprint(plain).batch
    assert (packed.seq_len, packed.rows, packed.response_len, packed.flash) == (4 * 24, 1, 96, True)
    assert Features([Packing()]).footprint(plain).batch.seq_len == 4 * 23  # no split: no padding
    assert Features([SequenceParallel(), Packing(max_tokens=51)]).footprint(plain).batch.seq_len == 52
    on_cpu = Features([Packing()]).footprint(dataclasses.replace(plain, cuda=False))
    assert on_cpu.batch.flash is False  # megatron's local attention
    without_te = dataclasses.replace(plain, transformer_engine=False)  # refused, as the build refuses it
    with pytest.raises(NeedsTransformerEngine, match=r"^critic\.packing: true on a CUDA device"):
        Features([Packing(key="critic.packing")]).footprint(without_te)
    lora = LoraConfig(rank=4, alpha=8)
    rest = Features([Recompute(), Lora(lora), Offload(("grads", "optimizer"))]).footprint(plain)
    assert rest.batch == dataclasses.replace(plain.batch, recompute=True)
    assert (rest.adapters, rest.offload) == (lora, ("grads", "optimizer"))
    moe = Features([RoutingReplay(), MoE()])
    assert moe.footprint(plain) == plain  # a mixture of experts' MLP is planned as a dense one
