"""Routing replay on a megatron MoE model (tiny Qwen3-MoE, 8 experts, top 2) on one rank: a
forward records every token's experts in the batch's layout, replaying a record makes every
router choose exactly it (padded and packed micro-batches alike), replaying a forward's own
record gives its outputs bit for bit, and the counts of decisions that differ are exact."""

import pytest
import torch
import torch.nn.functional as F

from rl3d.engine import Features, MegatronEngine, Training, micro_batches
from rl3d.engine.techniques import MoE, Packing, RoutingReplay
from rl3d.models.routing_replay import token_routing
from rl3d.models.spec import get_model_spec
from rl3d.single_controller.batch import ROUTING, ROUTING_DECISIONS, ROUTING_DIFFER, DataBatch

SPEC = get_model_spec("tiny-qwen3-moe")
B, P, R = 6, 5, 4
K, L, E = SPEC.moe_top_k, SPEC.num_layers, SPEC.num_experts


def _batch() -> DataBatch:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, SPEC.vocab_size, (B, P + R), generator=gen)
    prompt_len = torch.tensor([5, 3, 1, 4, 5, 2])
    resp_len = torch.tensor([4, 1, 3, 4, 2, 3])
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


def _role(groups, *, packing: bool) -> MegatronEngine:
    features = Features([Packing(), RoutingReplay()] if packing else [RoutingReplay()])
    return MegatronEngine(SPEC, groups, role="actor", params_dtype=torch.float32, seed=3, features=features)


class RouterMaps:
    """Every router's routing map [N, E] of each forward, per global layer."""

    def __init__(self, model):
        self.maps = {i: [] for i in range(L)}
        for layer in model.decoder.layers:
            index = layer.layer_number - 1
            layer.mlp.router.register_forward_hook(lambda _m, _a, out, i=index: self.maps[i].append(out[1]))


def _forward(role, batch, micro_batch_size=3, **kw):
    def extract(output, micro):
        return torch.zeros(()), {"logits": role.response_slice(output, micro).detach()}

    outs = role.run_forward(batch, micro_batch_size, extract, **kw)
    return torch.cat([o["logits"] for o in outs])


@pytest.mark.parametrize("packing", [False, True])
def test_replay_routes_by_the_record(groups_1x1, packing):
    role = _role(groups_1x1, packing=packing)
    batch = _batch()
    real_BT = batch["attention_mask"].bool()
    plain = _forward(role, batch)
    recorded = _forward(role, batch, record_routing=True)
    own = role.replay.result[ROUTING]
    assert own.shape == (B, P + R, L, K) and own.dtype == torch.int16
    assert torch.equal(plain, recorded)  # recording changes nothing
    # each real token's record is a set of k distinct experts
    assert (own[real_BT].sort(-1).values.diff(dim=-1) > 0).all()

    # replaying the forward's own record: the same outputs bit for bit, nothing differs
    replayed = _forward(role, batch.union(DataBatch({ROUTING: own})))
    assert torch.equal(plain, replayed)
    assert role.replay.result[ROUTING_DIFFER].sum() == 0
    assert torch.equal(role.replay.result[ROUTING_DECISIONS], real_BT.sum(1).float() * L)

    # another record (random k distinct experts per token): every router chooses exactly it
    gen = torch.Generator().manual_seed(1)
    target = torch.rand(B, P + R, L, E, generator=gen).argsort(-1)[..., :K].to(torch.int16)
    maps = RouterMaps(role.model)
    with_target = batch.union(DataBatch({ROUTING: target}))
    other = _forward(role, with_target, micro_batch_size=B)  # one micro-batch: the batch's order
    assert not torch.allclose(other, plain)
    micro = micro_batches.packed(with_target) if packing else with_target
    ids_NLK, real_N = token_routing(micro[ROUTING], micro, K)
    for layer in range(L):
        (routing_map,) = maps.maps[layer]
        want = F.one_hot(ids_NLK[:, layer], E).sum(1).bool()
        assert torch.equal(routing_map[real_N], want[real_N])
    # the counts: decisions (real token x layer) whose own expert set is not the record's. A
    # layer's own choice depends on the routing replayed below it: layer 0 replays its own
    # record, so layer 1 reads the hidden states its own record was made on
    mixed = target.clone()
    mixed[:, :, 0] = own[:, :, 0]
    _forward(role, batch.union(DataBatch({ROUTING: mixed})))
    differ_BTL = (own.sort(-1).values != mixed.sort(-1).values).any(-1) & real_BT[..., None]
    assert differ_BTL[..., 1].sum() > 0
    assert torch.equal(role.replay.result[ROUTING_DIFFER], differ_BTL.sum((1, 2)).float())
    fraction = differ_BTL.sum().item() / (real_BT.sum().item() * L)
    assert role.replay.mismatch(role.replay.result) == pytest.approx(fraction, abs=1e-12)


def test_packed_and_padded_record_the_same_routing(groups_1x1):
    padded, packed = _role(groups_1x1, packing=False), _role(groups_1x1, packing=True)
    packed.model.load_state_dict(padded.model.state_dict())
    batch = _batch()
    real_BT = batch["attention_mask"].bool()
    _forward(padded, batch, record_routing=True)
    _forward(packed, batch, record_routing=True)
    a, b = padded.replay.result[ROUTING], packed.replay.result[ROUTING]
    # the same experts (fp32 rounding of the two layouts' attention may break a near tie)
    same = (a[real_BT].sort(-1).values == b[real_BT].sort(-1).values).all(-1).float().mean()
    assert same >= 0.99, same


@pytest.mark.parametrize("packing", [False, True])
def test_engine_record_reaches_the_trainer_through_the_batch(groups_1x1, packing):
    """The engine (fp32, the trainer's own weights) records its routing; two generation-DP
    shares of different widths become rows (`rows_to_batch` + `routing_columns`), concatenate,
    split over two DP ranks by tokens and run as micro-batches: the trainer's router then
    agrees with the record it replays on every real token (a record shifted by one column or
    sample would disagree on most)."""
    from rl3d.rollout import SamplingParams, TorchRolloutEngine
    from rl3d.single_controller.batch import PROMPT_WIDTH
    from rl3d.single_controller.dispatch import Slot, _dp_share
    from rl3d.workers.generation import routing_columns, rows_to_batch

    role = _role(groups_1x1, packing=packing)
    engine = TorchRolloutEngine(SPEC, role.global_shards(), record_routing=True)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, SPEC.vocab_size, (n,), generator=gen).tolist() for n in (3, 6, 2, 5)]
    shares = []
    for part, new_tokens in ((prompts[:2], 4), (prompts[2:], 7)):  # responses of two widths
        share = DataBatch({"uid": torch.arange(len(part))}, {"prompt_ids": part}, {PROMPT_WIDTH: 6})
        out = engine.generate(part, SamplingParams(max_new_tokens=new_tokens, n=2, seed=5))
        rows = list(zip(out.prompt_index.tolist(), out.responses(), out.token_logprobs(), out.finish_reasons))
        batch = rows_to_batch(share, rows, pad_token_id=0)
        shares.append(batch.set(ROUTING, routing_columns(batch, out.routing)))
    batch = DataBatch.concat(shares)
    assert batch[ROUTING].shape == (8, 6 + 7, L, K)
    real = 0
    for rank in range(2):
        share = _dp_share(batch, Slot(rank, 2, True, token_balance=len(batch)))
        _forward(role, share, micro_batch_size=2)
        result = role.replay.result
        assert torch.equal(result[ROUTING_DECISIONS], share["attention_mask"].sum(1).float() * L)
        assert result[ROUTING_DIFFER].sum() <= 0.01 * result[ROUTING_DECISIONS].sum(), result[ROUTING_DIFFER]
        real += int(share["attention_mask"].sum())
    assert real == int(batch["attention_mask"].sum())


def test_update_replays_the_old_forward_and_trains_as_without_replay(groups_1x1):
    """`old`: the old-log-prob forward records, the update replays the record. Before the
    optimizer steps nothing differs, so its mismatch is 0 and the step equals an update without
    replay bit for bit; a foreign record changes the step."""
    from rl3d.config.schema import OptimConfig

    kw = dict(role="actor", params_dtype=torch.float32, seed=3, training=Training(OptimConfig(lr=1e-2)))
    # a trained MoE role counts its expert loads (`MoE`): with and without replay alike
    features = [[RoutingReplay(), MoE()], [MoE()], [RoutingReplay(), MoE()]]
    roles = [MegatronEngine(SPEC, groups_1x1, features=Features(f), **kw) for f in features]
    for other in roles[1:]:
        other.model.load_state_dict(roles[0].model.state_dict())
    batch = _batch()
    _forward(roles[0], batch, record_routing=True)
    own = roles[0].replay.result[ROUTING]
    gen = torch.Generator().manual_seed(1)
    foreign = torch.rand(B, P + R, L, E, generator=gen).argsort(-1)[..., :K].to(torch.int16)

    def update(role, routing):
        def loss_of(output, micro):
            logits = role.response_slice(output, micro).float()
            return -(logits.log_softmax(-1).gather(-1, micro["responses"][..., None]).mean()), {}

        with_record = batch if routing is None else batch.union(DataBatch({ROUTING: routing}))
        rows = role.train_minibatches(
            with_record,
            mini_batch_size=B,
            micro_batch_size=3,
            epochs=1,
            loss_of=loss_of,
            count_unit=lambda m: 1.0,
        )
        return {k: v for r in rows for k, v in r.items() if k.startswith("moe/routing")}

    assert update(roles[0], own) == {"moe/routing_mismatch_update": 0.0}
    assert update(roles[1], None) == {}
    foreign_metrics = update(roles[2], foreign)
    assert foreign_metrics["moe/routing_mismatch_update"] > 0.5
    after = [dict(r.unwrapped().named_parameters()) for r in roles]
    assert all(torch.equal(p, after[1][n]) for n, p in after[0].items())
    assert not all(torch.equal(p, after[1][n]) for n, p in after[2].items())
