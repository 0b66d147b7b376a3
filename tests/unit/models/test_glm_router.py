"""GLM-4.5's sigmoid router with its expert bias on a megatron model on one rank (tiny: a dense
first layer, 3 MoE layers of 8 experts, top 2), and DeepSeek-V3's with group-limited routing
(16 experts in 4 groups, top 4 from the best 2 groups, MLA): routing replay records and replays
it as it does a softmax router; the auxiliary-loss-free bias update moves each expert's bias by
exactly +-rate against its load of the step (nothing at the default rate 0); the expert-load
metrics count its routing and report the bias."""

import pytest
import torch
import torch.nn.functional as F

from rl3d.config import ConfigError, load_config
from rl3d.config.schema import OptimConfig
from rl3d.engine import Features, MegatronEngine, Training
from rl3d.engine.techniques import MoE, RoutingReplay
from rl3d.models.routing_replay import token_routing
from rl3d.models.spec import get_model_spec
from rl3d.single_controller.batch import ROUTING, ROUTING_DIFFER, DataBatch

SPEC = get_model_spec("tiny-glm4-moe")
B, P, R = 4, 5, 4
SIGMOID_ROUTERS = ("tiny-glm4-moe", "tiny-deepseek-v3")


def _shape(spec):
    """(K, L, E, the MoE layers) of `spec`."""
    return (
        spec.moe_top_k,
        spec.num_layers,
        spec.num_experts,
        range(spec.moe_first_dense_layers, spec.num_layers),
    )


def _batch() -> DataBatch:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, SPEC.vocab_size, (B, P + R), generator=gen)
    prompt_len, resp_len = torch.tensor([5, 3, 1, 4]), torch.tensor([4, 1, 3, 4])
    cols = torch.arange(P + R)
    mask = ((cols >= P - prompt_len[:, None]) & (cols < P + resp_len[:, None])).long()
    return DataBatch(
        {
            "input_ids": ids * mask,
            "attention_mask": mask,
            "responses": ids[:, P:] * mask[:, P:],
            "response_mask": mask[:, P:],
        }
    )


def _engine(groups, features, spec=SPEC, **kw) -> MegatronEngine:
    engine = MegatronEngine(
        spec, groups, role="actor", params_dtype=torch.float32, seed=3, features=features, **kw
    )
    _, _, E, moe_layers = _shape(spec)
    with torch.no_grad():  # a random bias, so that it steers the choice
        gen = torch.Generator().manual_seed(5)
        for i in moe_layers:
            engine.model.decoder.layers[i].mlp.router.expert_bias.copy_(0.1 * torch.randn(E, generator=gen))
    return engine


def _forward(role, batch, micro_batch_size=B, **kw):
    def extract(output, micro):
        return torch.zeros(()), {"logits": role.response_slice(output, micro).detach()}

    return torch.cat([o["logits"] for o in role.run_forward(batch, micro_batch_size, extract, **kw)])


@pytest.mark.parametrize("name", SIGMOID_ROUTERS)
def test_replay_records_and_replays_the_sigmoid_router(groups_1x1, name):
    spec = get_model_spec(name)
    K, L, E, MOE_LAYERS = _shape(spec)  # noqa: N806
    role = _engine(groups_1x1, Features([RoutingReplay()]), spec)
    batch = _batch()
    plain = _forward(role, batch)
    recorded = _forward(role, batch, record_routing=True)
    own = role.replay.result[ROUTING]
    assert own.shape == (B, P + R, L, K) and torch.equal(plain, recorded)
    assert not own[:, :, 0].any()  # the dense layer routes nothing
    replayed = _forward(role, batch.union(DataBatch({ROUTING: own})))
    assert torch.equal(plain, replayed) and role.replay.result[ROUTING_DIFFER].sum() == 0

    gen = torch.Generator().manual_seed(1)  # a foreign record: every router takes exactly it
    target = torch.rand(B, P + R, L, E, generator=gen).argsort(-1)[..., :K].to(torch.int16)
    maps = {}

    def keep(layer):
        def hook(_module, _args, out):
            maps[layer] = out[1]

        return hook

    for i in MOE_LAYERS:
        role.model.decoder.layers[i].mlp.router.register_forward_hook(keep(i))
    other = _forward(role, batch.union(DataBatch({ROUTING: target})))
    assert not torch.allclose(other, plain)
    ids_NLK, real_N = token_routing(target, batch, K)
    for i in MOE_LAYERS:
        want = F.one_hot(ids_NLK[:, i], E).sum(1).bool()
        assert torch.equal(maps[i][real_N], want[real_N]), i


def _update(role, batch):
    def loss_of(output, micro):
        logits = role.response_slice(output, micro).float()
        return -(logits.log_softmax(-1).gather(-1, micro["responses"][..., None]).mean()), {}

    rows = role.train_minibatches(
        batch, mini_batch_size=B, micro_batch_size=2, epochs=1, loss_of=loss_of, count_unit=lambda m: 1.0
    )
    return {k: v for r in rows for k, v in r.items() if k.startswith("moe/")}


@pytest.mark.parametrize("name", SIGMOID_ROUTERS)
@pytest.mark.parametrize("rate", [0.0, 0.01])
def test_bias_update_moves_each_expert_against_its_load(groups_1x1, rate, name):
    """megatron's update after the step: bias += rate * sign(mean load - load) per layer, from
    the tokens each expert got in the step's forwards (the expert-load counts: padding slots
    included, as both count them)."""
    spec = get_model_spec(name)
    K, _, _, MOE_LAYERS = _shape(spec)  # noqa: N806
    moe = MoE({"moe_router_bias_update_rate": rate} if rate else None)
    role = _engine(groups_1x1, Features([moe]), spec, training=Training(OptimConfig(lr=1e-3)))
    routers = [role.model.decoder.layers[i].mlp.router for i in MOE_LAYERS]
    before = [r.expert_bias.clone() for r in routers]
    metrics = _update(role, _batch())
    counts_LE = moe.load.counts_LE
    for i, router, old in zip(MOE_LAYERS, routers, before, strict=True):
        load = counts_LE[i].float()
        assert load.sum() > 0 and load.sum() % K == 0  # k experts per token slot
        expected = old + rate * torch.sign(load.mean() - load)
        assert torch.equal(router.expert_bias, expected), i
        assert torch.equal(router.expert_bias, old) == (rate == 0), i
        assert router.expert_bias.dtype == torch.float32
    assert metrics["moe/expert_bias_abs_max"] == pytest.approx(
        max(float(r.expert_bias.abs().max()) for r in routers)
    )
    assert metrics["moe/layer_0/load_max_over_mean"] == 0.0  # the dense layer
    assert all(metrics[f"moe/layer_{i}/load_max_over_mean"] >= 1.0 for i in MOE_LAYERS)


def test_the_update_rate_is_a_recipe_key_refused_without_a_bias():
    grpo = "recipes/quickstart_cpu_grpo.yaml"
    cfg = load_config(grpo, ["model.name=tiny-glm4-moe", "actor.moe.expert_bias_update_rate=0.001"]).config
    assert cfg.actor.moe.transformer_overrides() == {"moe_router_bias_update_rate": 0.001}
    with pytest.raises(ConfigError, match=r"actor\.moe\.expert_bias_update_rate: .*no router expert bias"):
        load_config(grpo, ["model.name=tiny-qwen3-moe", "actor.moe.expert_bias_update_rate=0.001"])
    with pytest.raises(ConfigError, match=r"actor\.moe\.expert_bias_update_rate: must be a number >= 0"):
        load_config(grpo, ["model.name=tiny-glm4-moe", "actor.moe.expert_bias_update_rate=-1"])
