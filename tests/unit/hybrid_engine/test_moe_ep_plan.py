"""The transition from an expert-parallel training layout (p-t-ep-d): every generation rank gets
every expert of its stage, each needed segment exactly once, from a rank that trains it.

The check replays the plan's collectives piece by piece: what each receiver gets, from whom,
and the segments those pieces are, against what the receiver holds and needs."""

import pytest

import rl3d.bench  # noqa: F401  registers hybridflow_hier and the baselines
from rl3d.hybrid_engine.plan import plan_transition
from rl3d.hybrid_engine.pool import plan_pool_transition
from rl3d.models.params import expert_owner, model_params
from rl3d.models.spec import get_model_spec
from rl3d.parallel import GenerationLayout, ParallelLayout

LAYOUTS = [  # (model, p, t, d, ep, t_g, p_g)
    ("tiny-qwen3-moe", 1, 1, 2, 2, 1, 1),  # identity for dense weights: only experts move
    ("tiny-qwen3-moe", 1, 2, 2, 2, 1, 1),
    ("tiny-qwen3-moe", 1, 2, 4, 2, 2, 1),  # two EP groups (edp = 2), identity for dense
    ("tiny-qwen3-moe", 2, 2, 4, 4, 1, 1),  # PP folds into micro-DP: norms travel too
    ("tiny-qwen3-moe", 2, 1, 8, 8, 1, 2),
    ("tiny-qwen2-moe", 2, 2, 2, 2, 1, 1),  # shared expert: dense, replicated over dp
    ("qwen3-30b-a3b", 1, 2, 8, 8, 1, 1),
]


def replay(plan, ctx, strategy):
    """{receiver: [(sender, param index, sender's training TP rank)]} of every delivered piece."""
    got: dict[int, list[tuple[int, int, int]]] = {}
    s = plan.strategies[strategy]
    for c in s.collectives:
        for group, contrib in zip(c.groups, c.contributions):
            for dst in c.receivers(group):
                for src in group:
                    if src != dst:
                        got.setdefault(dst, []).extend(
                            (src, i, ctx.train.coords(src).tp) for i in contrib[src]
                        )
    for phase in s.phases:
        for t in phase:
            got.setdefault(t.dst, []).extend((t.src, i, ctx.train.coords(h).tp) for h, i in t.pieces)
    return got


@pytest.mark.parametrize(("name", "p", "t", "d", "ep", "t_g", "p_g"), LAYOUTS)
@pytest.mark.parametrize("strategy", ["hybridflow", "hybridflow_hier"])
def test_each_rank_gets_exactly_the_segments_it_lacks_once(name, p, t, d, ep, t_g, p_g, strategy):
    spec = get_model_spec(name)
    train = ParallelLayout(p, t, d, ep=ep)
    plan = plan_transition(spec, train, t_g, p_g, strategies=(strategy,))
    ctx = plan._ctx
    got = replay(plan, ctx, strategy)
    cost = plan.strategies[strategy]
    for rank in range(train.world_size):
        own, need = ctx.train_segs(rank), ctx.gen_segs(rank)
        received: list[int] = []
        for src, i, src_tp in got.get(rank, []):
            received += ctx.table.shard(i, src_tp, t)
            param = ctx.params[i]
            if param.expert is not None and strategy == "hybridflow":  # straight from a holder
                assert expert_owner(spec, param.expert, ep)[0] == train.coords(src).ep, (rank, src, param)
        assert len(received) == len(set(received)), f"rank {rank} receives a segment twice"
        assert not own & set(received), f"rank {rank} receives a segment it holds"
        assert set(received) == need - own, f"rank {rank} misses or gets extra segments"
        # counted = planned: the plan's bytes are the bytes of those segments, nothing else
        assert cost.ranks[rank].recv_bytes == ctx.nbytes(need - own)
        assert cost.ranks[rank].redundant_bytes == ctx.nbytes(own - need)
    # every generation rank needs every expert of its stage
    gen = GenerationLayout.from_training(train, t_g, p_g)
    for rank in range(train.world_size):
        needed = {ctx.params[i].expert for i in ctx.gen_params(rank)} - {None}
        assert needed == set(range(spec.num_experts)), rank
    assert gen.world_size == train.world_size


def test_a_rank_trains_only_its_ep_ranks_experts():
    spec = get_model_spec("tiny-qwen3-moe")
    train = ParallelLayout(1, 1, 4, ep=2)
    ctx = plan_transition(spec, train, 1, strategies=("hybridflow",))._ctx
    for rank in range(4):
        experts = {ctx.params[i].expert for i in ctx.train_params(rank)} - {None}
        k = train.coords(rank).ep
        assert experts == set(range(4 * k, 4 * k + 4)), rank  # 8 experts over ep 2


def test_expert_groups_join_the_micro_dp_groups_of_an_ep_group():
    gen = GenerationLayout.from_training(ParallelLayout(1, 2, 4, ep=2), 1)
    # rank = tp + 2 dp; EP groups are dp {0, 1} and {2, 3}; micro-DP joins tp 0 and 1
    assert gen.expert_micro_dp_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert gen.micro_dp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert GenerationLayout.from_training(ParallelLayout(1, 2, 4), 1).expert_micro_dp_groups() == (
        gen.micro_dp_groups()
    )


def test_strategies_without_expert_parallelism_are_refused():

    spec = get_model_spec("tiny-qwen3-moe")
    with pytest.raises(ValueError, match="does not plan expert parallelism.*ep=2"):
        plan_transition(spec, ParallelLayout(1, 1, 2, ep=2), 1, strategies=("ds_chat",))


def test_a_rollout_pool_gets_each_expert_from_its_ep_rank():
    spec = get_model_spec("tiny-qwen3-moe")
    train = ParallelLayout(1, 1, 4, ep=4)
    pool = plan_pool_transition(spec, train, gen_tp=1, gen_dp=1, dtype="float32", bucket_bytes=1 << 30)
    params = model_params(spec, train_tp=1)
    for t in pool.transfers(pool.rank_of(0)):
        for holder, i in t.pieces:
            expert = params[i].expert
            assert holder == (0 if expert is None else expert // 2), params[i].name
    total = sum(p.numel for p in params if not p.tied_copy) * 4
    assert pool.bytes_to(0) == total


def test_cli_plans_an_expert_parallel_layout():
    import json
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "rl3d.cli", "plan", "--model", "qwen3-30b-a3b", "--train", "1,4,8,8"]
    out = subprocess.run([*cmd, "--gen", "4,1", "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    experts, dense = plan["moe"]["experts"], plan["moe"]["dense"]
    # a rank trains 1/(t ep) of the experts and generates with 1/t_g of them: it receives the rest
    assert experts["train_max"] == experts["model_bytes"] // 32
    assert experts["held_max"] == experts["model_bytes"] // 4
    assert experts["recv_max"] == experts["held_max"] - experts["train_max"]
    assert dense["recv_max"] == 0  # t_g = t: the dense weights stay in place
    assert set(plan["strategies"]) == {"hybridflow", "hybridflow_hier"}  # the baselines do not plan ep
    bad = subprocess.run([*cmd[:-1], "1,4,8,3", "--gen", "4,1"], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "ep=3 must divide the data-parallel size d=8" in bad.stderr
