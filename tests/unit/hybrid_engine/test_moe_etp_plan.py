"""The transition from experts trained at an expert TP size apart from TP (`etp`): every
generation rank (t_g = 1) gets every expert of its stage whole, each needed segment exactly
once, from a rank that trains that expert shard; received bytes = planned, 0 redundant."""

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


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda s, tr: plan_transition(s, tr, 2, strategies=("hybridflow",)), r"rollout\.t_g=2: .*etp=1"),
        (
            lambda s, tr: plan_transition(s, tr, 1, strategies=("hybridflow_hier",)),
            r"hybrid_engine\.strategy",
        ),
        (
            lambda s, tr: plan_pool_transition(s, tr, gen_tp=1, gen_dp=1, dtype="float32", bucket_bytes=1),
            r"actor\.parallel\.etp=1: a separate rollout pool",
        ),
    ],
    ids=["t_g", "strategy", "pool"],
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
    bad = subprocess.run(
        [*cmd, "--gen", "4,1", "--strategy", "hybridflow"], capture_output=True, text=True, timeout=120
    )
    assert bad.returncode != 0 and "rollout.t_g=4" in bad.stderr
