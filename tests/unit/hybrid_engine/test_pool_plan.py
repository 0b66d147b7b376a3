"""The pool transition's planner (shapes only): each rollout rank gets exactly the training TP
shards its generation shard is made of, M / t_g bytes, from data-parallel replica 0 of the stage
that holds each parameter, in buckets no larger than asked (unless one piece is). The plan is a
`StrategyPlan` of point-to-point phases whose per-rank bytes are the plan's traffic."""

import pytest

from rl3d.hybrid_engine.plan import rank_traffic
from rl3d.hybrid_engine.pool import POOL, plan_pool_transition, train_shards_for
from rl3d.models.params import model_params
from rl3d.models.spec import get_model_spec
from rl3d.parallel.layout import ParallelLayout

SPEC = get_model_spec("tiny-llama")


def model_bytes(t: int) -> int:
    return sum(p.numel for p in model_params(SPEC, train_tp=t) if not p.tied_copy) * 4


def plan_of(train, t_g, d_g, bucket_bytes=64 * 1024):
    return plan_pool_transition(
        SPEC, train, gen_tp=t_g, gen_dp=d_g, dtype="float32", bucket_bytes=bucket_bytes
    )


@pytest.mark.parametrize(
    "p,t,d,t_g,d_g",
    [(1, 1, 1, 1, 1), (1, 2, 1, 1, 1), (1, 2, 1, 2, 1), (2, 2, 2, 1, 2), (1, 1, 2, 2, 1), (2, 4, 1, 2, 3)],
)
def test_each_rollout_rank_gets_its_generation_shard_once(p, t, d, t_g, d_g):
    train = ParallelLayout(p, t, d)
    plan = plan_of(train, t_g, d_g)
    assert plan.plan.strategy == POOL and not plan.plan.collectives
    params = {q.name: q for q in model_params(SPEC, train_tp=t) if not q.tied_copy}
    replicated = sum(q.numel for q in params.values() if q.kind.value == "replicated") * 4
    sharded = model_bytes(t) - replicated
    for j in range(t_g * d_g):
        got = {}
        for transfer in plan.transfers(plan.rank_of(j)):
            assert transfer.dst == train.world_size + j and train.coords(transfer.src).dp == 0  # replica 0
            for holder, i in transfer.pieces:
                assert holder == transfer.src  # no relay: every piece comes from its holder
                got.setdefault(plan.params[i].name, []).append(train.coords(holder).tp)
        assert set(got) == set(params)
        a = j % t_g
        for name, shards in got.items():
            want = [0] if params[name].kind.value == "replicated" else train_shards_for(a, t, t_g)
            assert sorted(shards) == want, name
        # sharded parameters: 1/t_g of them (or 1/t when t_g > t: the covering training shard)
        assert plan.bytes_to(j) == replicated + sharded * len(train_shards_for(a, t, t_g)) // t
    assert plan.total_bytes == sum(plan.bytes_to(j) for j in range(t_g * d_g))
    # the ranks' costs are the traffic the executor counts from the phases (the planner's own)
    pairs: dict = {}
    for phase in plan.plan.phases:
        for tr in phase:
            n = sum(
                plan.params[i].numel // (1 if plan.params[i].kind.value == "replicated" else t)
                for _, i in tr.pieces
            )
            pairs[(tr.src, tr.dst)] = pairs.get((tr.src, tr.dst), 0) + n * 4
    recv, send = rank_traffic(pairs)
    assert [(r.recv_bytes, r.send_bytes) for r in plan.plan.ranks] == [
        (recv.get(r, 0), send.get(r, 0)) for r in range(train.world_size + t_g * d_g)
    ]


def test_buckets_respect_the_size():
    plan = plan_of(ParallelLayout(1, 1, 1), 1, 1, bucket_bytes=32 * 1024)
    transfers = plan.transfers(0)
    assert len(transfers) > 1 and plan.num_sends == len(transfers) == len(plan.plan.phases)
    indices = [i for tr in transfers for _, i in tr.pieces]
    assert indices == [i for i, q in enumerate(plan.params) if not q.tied_copy]  # in order, each once
    for tr in transfers:
        size = sum(plan.params[i].numel for _, i in tr.pieces) * 4
        assert size <= 32 * 1024 or len(tr.pieces) == 1


def test_layouts_that_do_not_nest_are_refused():
    with pytest.raises(ValueError, match="t_g=3"):
        plan_of(ParallelLayout(1, 2, 1), 3, 1, bucket_bytes=1)
    with pytest.raises(ValueError, match="unknown dtype 'fp8'"):
        plan_pool_transition(SPEC, ParallelLayout(1, 1, 1), gen_tp=1, gen_dp=1, dtype="fp8", bucket_bytes=1)
