"""The transition from experts trained at an expert TP size apart from TP (`etp`): every
generation rank gets its t_g shard of every expert of its stage (whole at t_g = 1), each needed
segment exactly once, from a rank that trains that expert shard; received bytes = planned."""

import pytest

from rl3d.hybrid_engine.plan import plan_transition
from rl3d.hybrid_engine.pool import plan_pool_transition
from rl3d.models.params import expert_owner
from rl3d.models.spec import get_model_spec
from rl3d.parallel import GenerationLayout, ParallelLayout

LAYOUTS = [  # (model, p, t, d, ep, etp, p_g)
    ("tiny-qwen3-moe", 1, 2, 2, 2, 1, 1),  # a TP group is an EP group
    ("tiny-qwen3-moe", 1, 2, 2, 4, 1, 1),  # one EP group of 4: the whole world
    ("tiny-qwen3-moe", 2, 2, 2, 2, 1, 1),  # PP folds into micro-DP: norms travel too
    ("qwen3-30b-a3b", 1, 4, 2, 2, 2, 1),  # experts in halves over expert TP (4 KV heads at t 4)
    ("tiny-qwen2-moe", 1, 2, 2, 2, 1, 1),  # shared expert: dense, split over TP
    ("qwen3-30b-a3b", 1, 4, 8, 8, 1, 1),
]


@pytest.mark.parametrize(("name", "p", "t", "d", "ep", "etp", "p_g"), LAYOUTS)
def test_each_rank_gets_exactly_the_segments_it_lacks_once(name, p, t, d, ep, etp, p_g):
    spec = get_model_spec(name)
    train = ParallelLayout(p, t, d, ep=ep, etp=etp)
    plan = plan_transition(spec, train, 1, p_g, strategies=("hybridflow",))
    ctx, cost = plan._ctx, plan.strategies["hybridflow"]
    got: dict[int, list[tuple[int, int]]] = {}
    for c in cost.collectives:
        for group, contrib in zip(c.groups, c.contributions):
            for dst in c.receivers(group):
                got.setdefault(dst, []).extend((src, i) for src in group if src != dst for i in contrib[src])
    for rank in range(train.world_size):
        own, need = ctx.train_segs(rank), ctx.gen_segs(rank)
        received: list[int] = []
        for src, i in got.get(rank, []):
            received += ctx.table.shard(i, *ctx.split_of(i, src))
            expert = ctx.params[i].expert
            if expert is not None:  # straight from a rank training that expert
                assert expert_owner(spec, expert, ep)[0] == train.coords(src).ep, (rank, src, i)
        assert len(received) == len(set(received)), f"rank {rank} receives a segment twice"
        assert not own & set(received), f"rank {rank} receives a segment it holds"
        assert set(received) == need - own, f"rank {rank} misses or gets extra segments"
        assert cost.ranks[rank].recv_bytes == ctx.nbytes(need - own)
        assert cost.ranks[rank].redundant_bytes == ctx.nbytes(own - need) == 0
        held = {ctx.params[i].expert for i in ctx.train_params(rank)} - {None}
        assert len(held) == spec.num_experts // ep  # its EP rank's experts ...
        expert = next(i for i in ctx.train_params(rank) if ctx.params[i].expert is not None)
        assert ctx.nbytes(ctx.table.shard(expert, *ctx.split_of(expert, rank))) * etp == ctx.nbytes(
            ctx.table.full(expert)
        )  # ... each split over etp


def test_expert_groups_hold_every_expert_shard_once():
    train = ParallelLayout(1, 2, 2, ep=2, etp=1)
    gen = GenerationLayout.from_training(train, 1)
    assert gen.expert_micro_dp_groups() == [[0, 1], [2, 3]] == train.ep_groups()


GEN_TP_LAYOUTS = [  # (model, p, t, d, ep, etp, t_g, p_g)
    ("tiny-qwen3-moe", 1, 2, 2, 2, 1, 2, 1),  # dense in place (identity), experts halved
    ("tiny-qwen3-moe", 1, 4, 2, 2, 1, 2, 1),  # etp 1 < t_g 2 < t 4
    ("tiny-qwen3-moe", 1, 4, 2, 2, 1, 4, 1),
    ("tiny-qwen3-moe", 1, 4, 2, 2, 2, 4, 1),  # a generation shard is half an etp shard
    ("tiny-qwen3-moe", 1, 4, 2, 2, 2, 2, 1),  # etp = t_g, on other ranks than the TP halves
    ("tiny-qwen3-moe", 2, 2, 2, 2, 1, 2, 1),  # PP folds into micro-DP: experts of both stages
    ("tiny-qwen2-moe", 1, 8, 2, 2, 4, 2, 1),  # a generation shard is two etp shards; a shared expert
    ("qwen3-30b-a3b", 1, 4, 8, 8, 1, 4, 1),
]


@pytest.mark.parametrize(("name", "p", "t", "d", "ep", "etp", "t_g", "p_g"), GEN_TP_LAYOUTS)
def test_each_rank_gets_its_generation_shard_of_every_expert_once(name, p, t, d, ep, etp, t_g, p_g):
    spec = get_model_spec(name)
    train = ParallelLayout(p, t, d, ep=ep, etp=etp)
    plan = plan_transition(spec, train, t_g, p_g, strategies=("hybridflow",))
    ctx, cost = plan._ctx, plan.strategies["hybridflow"]
    assert len(cost.phases) == 1 and all(x.unit == "slice" for x in cost.phases[0])
    experts = {i for i, q in enumerate(ctx.params) if q.expert is not None}
    expert_segs = {s for i in experts for s in ctx.table.full(i)}
    for c in cost.collectives:  # the dense weights' all-gathers carry no expert
        assert not any(experts & set(m) for contrib in c.contributions for m in contrib.values())
    received: dict[int, list[int]] = {}
    for x in cost.phases[0]:
        tp_g = plan.gen.coords(x.dst).tp_g
        for holder, i in x.pieces:
            assert holder == x.src and i in experts and i in ctx.train_params(holder)
            held = set(ctx.table.shard(i, *ctx.split_of(i, holder)))
            part = held & set(ctx.table.shard(i, tp_g, t_g))
            assert part, (x, i)  # nothing sent that the receiver does not generate with
            received.setdefault(x.dst, []).extend(part)
    dense_recv, _ = ctx.traffic(cost.collectives)
    for rank in range(train.world_size):
        own, need = ctx.train_segs(rank), ctx.gen_segs(rank)
        got = received.get(rank, [])
        assert len(got) == len(set(got)), f"rank {rank} receives an expert segment twice"
        assert set(got) == (need - own) & expert_segs, f"rank {rank} misses or gets extra expert segments"
        assert cost.ranks[rank].recv_bytes == dense_recv.get(rank, 0) + ctx.nbytes(got)
        assert cost.ranks[rank].peak_param_bytes == ctx.nbytes(need)
        # its experts' bytes once done: exactly the t_g shard of every expert of its stage
        stage_experts = [i for i in ctx.gen_params(rank) if i in experts]
        whole = sum(ctx.nbytes(ctx.table.full(i)) for i in stage_experts)
        assert ctx.nbytes(need & expert_segs) * t_g == whole


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda s, tr: plan_transition(s, tr, 1, strategies=("hybridflow_hier",)),
            r"hybrid_engine\.strategy",
        ),
        (
            lambda s, tr: plan_pool_transition(s, tr, gen_tp=1, gen_dp=1, dtype="float32", bucket_bytes=1),
            r"actor\.parallel\.etp=1: a separate rollout pool",
        ),
    ],
    ids=["strategy", "pool"],
)
def test_what_is_not_planned_is_refused_by_key(call, message):
    import rl3d.bench  # noqa: F401  registers hybridflow_hier

    with pytest.raises(ValueError, match=message):
        call(get_model_spec("tiny-qwen3-moe"), ParallelLayout(1, 2, 2, ep=2, etp=1))


def test_cli_plans_expert_tp_apart_from_tp():
    import json
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "rl3d.cli", "plan", "--model", "qwen3-30b-a3b", "--train", "1,4,8,8,1"]
    out = subprocess.run(
        [*cmd, "--gen", "1,1", "--strategy", "hybridflow", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    experts = json.loads(out.stdout)["moe"]["experts"]
    # a rank trains 1/ep of the experts, whole (etp 1), and generates with all of them (t_g 1)
    assert experts["train_max"] == experts["model_bytes"] // 8
    assert experts["held_max"] == experts["model_bytes"]
    assert experts["recv_max"] == experts["held_max"] - experts["train_max"]
    out = subprocess.run(
        [*cmd, "--gen", "4,1", "--strategy", "hybridflow", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    experts = json.loads(out.stdout)["moe"]["experts"]
    # at t_g 4 a rank generates with a quarter of every expert; it trains a quarter of that
    assert experts["held_max"] == experts["model_bytes"] // 4
    assert experts["recv_max"] == experts["held_max"] - experts["model_bytes"] // 32
