"""The weight-sync planner (shapes only): each rollout rank gets exactly the training TP shards
its generation shard is made of, M / t_g bytes, from data-parallel replica 0 of the stage that
holds each parameter, in buckets no larger than asked (unless one piece is)."""

import pytest

from rl3d.models.params import model_params
from rl3d.models.spec import get_model_spec
from rl3d.parallel.layout import ParallelLayout
from rl3d.weight_sync import plan_weight_sync
from rl3d.weight_sync.plan import train_shards_for

SPEC = get_model_spec("tiny-llama")


def model_bytes(t: int) -> int:
    return sum(p.numel for p in model_params(SPEC, train_tp=t) if not p.tied_copy) * 4


@pytest.mark.parametrize(
    "p,t,d,t_g,d_g",
    [(1, 1, 1, 1, 1), (1, 2, 1, 1, 1), (1, 2, 1, 2, 1), (2, 2, 2, 1, 2), (1, 1, 2, 2, 1), (2, 4, 1, 2, 3)],
)
def test_each_rollout_rank_gets_its_generation_shard_once(p, t, d, t_g, d_g):
    train = ParallelLayout(p, t, d)
    plan = plan_weight_sync(SPEC, train, gen_tp=t_g, gen_dp=d_g, bytes_per_element=4, bucket_bytes=64 * 1024)
    params = {q.name: q for q in model_params(SPEC, train_tp=t) if not q.tied_copy}
    replicated = sum(q.numel for q in params.values() if q.kind.value == "replicated") * 4
    sharded = model_bytes(t) - replicated
    for dst in range(t_g * d_g):
        got = {}
        for route in plan.routes_to(dst):
            c = train.coords(route.src)
            assert c.dp == 0  # replica 0 sends
            for piece in route.pieces:
                got.setdefault(piece.name, []).append(piece.train_tp)
        assert set(got) == set(params)
        a = dst % t_g
        for name, shards in got.items():
            want = [0] if params[name].kind.value == "replicated" else train_shards_for(a, t, t_g)
            assert sorted(shards) == want, name
        # sharded parameters: 1/t_g of them (or 1/t when t_g > t: the covering training shard)
        assert plan.bytes_to(dst) == replicated + sharded * len(train_shards_for(a, t, t_g)) // t
    assert plan.total_bytes == sum(plan.bytes_to(r) for r in range(t_g * d_g))


def test_buckets_respect_the_size():
    plan = plan_weight_sync(
        SPEC, ParallelLayout(1, 1, 1), gen_tp=1, gen_dp=1, bytes_per_element=4, bucket_bytes=32 * 1024
    )
    (route,) = plan.routes
    assert [lo for lo, _ in route.buckets][0] == 0 and route.buckets[-1][1] == len(route.pieces)
    for lo, hi in route.buckets:
        size = sum(piece.numel for piece in route.pieces[lo:hi]) * 4
        assert size <= 32 * 1024 or hi - lo == 1
    assert len(route.buckets) > 1 and plan.num_sends == len(route.buckets)


def test_layouts_that_do_not_nest_are_refused():
    with pytest.raises(ValueError, match="t_g=3"):
        plan_weight_sync(
            SPEC, ParallelLayout(1, 2, 1), gen_tp=3, gen_dp=1, bytes_per_element=4, bucket_bytes=1
        )
