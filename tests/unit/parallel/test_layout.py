"""Training and generation layouts: megatron rank order and the paper's regrouping rule."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rl3d.parallel import GenerationLayout, ParallelLayout


def test_paper_8_gpu_example():
    gen = GenerationLayout.from_training(ParallelLayout(p=1, t=4, d=2), t_g=2, p_g=1)
    assert gen.d_g == 2
    assert gen.gen_tp_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert gen.micro_dp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert str(gen) == "1-2-2-2"


def test_megatron_rank_order():
    layout = ParallelLayout(p=2, t=2, d=3)
    assert layout.rank_of(pp=1, dp=2, tp=1) == 1 + 2 * (2 + 3 * 1)
    assert layout.tp_groups()[0] == [0, 1]
    assert layout.dp_groups()[0] == [0, 2, 4]
    assert layout.pp_groups()[0] == [0, 6]


def test_pp_folds_into_micro_dp():
    gen = GenerationLayout.from_training(ParallelLayout(p=2, t=2, d=2), t_g=2, p_g=1)
    assert gen.d_g == 2
    assert gen.micro_dp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert gen.gen_tp_groups() == [[0, 1], [4, 5], [2, 3], [6, 7]]


@pytest.mark.parametrize(
    "p, t, d, t_g, p_g, reason",
    [
        (1, 4, 2, 3, 1, "t_g=3 must divide training t=4"),
        (2, 2, 1, 1, 4, "p_g=4 must divide training p=2"),
        (1, 0, 1, 1, 1, "t must be a positive integer"),
        (1, 2, 1, 0, 1, "t_g must be a positive integer"),
    ],
)
def test_invalid_layouts_say_why(p, t, d, t_g, p_g, reason):
    with pytest.raises(ValueError, match=reason):
        GenerationLayout.from_training(ParallelLayout(p, t, d), t_g, p_g)


def test_rank_outside_world():
    with pytest.raises(ValueError, match="rank 8 outside world of size 8"):
        ParallelLayout(1, 4, 2).coords(8)


@st.composite
def layouts(draw):
    p, t, d = (draw(st.sampled_from([1, 2, 3, 4])) for _ in range(3))
    t_g = draw(st.sampled_from([k for k in range(1, t + 1) if t % k == 0]))
    p_g = draw(st.sampled_from([k for k in range(1, p + 1) if p % k == 0]))
    return GenerationLayout.from_training(ParallelLayout(p, t, d), t_g, p_g)


def _is_partition(groups, world):
    flat = [r for g in groups for r in g]
    return sorted(flat) == list(range(world))


@given(layouts())
def test_groups_partition_the_world_and_agree_with_coords(gen):
    world = gen.world_size
    for groups, size in [
        (gen.gen_tp_groups(), gen.t_g),
        (gen.gen_pp_groups(), gen.p_g),
        (gen.micro_dp_groups(), gen.d_g),
        (gen.gen_dp_groups(), gen.d_g * gen.train.d),
    ]:
        assert _is_partition(groups, world) and all(len(g) == size for g in groups)
    for group in gen.gen_tp_groups():
        coords = [gen.coords(r) for r in group]
        assert [c.tp_g for c in coords] == list(range(gen.t_g))
        # stride r along training TP
        tps = [gen.train.coords(r).tp for r in group]
        assert all(b - a == gen.r for a, b in zip(tps, tps[1:]))
    for group in gen.micro_dp_groups():
        coords = [gen.coords(r) for r in group]
        assert len({(c.tp_g, c.pp_g, c.dp) for c in coords}) == 1
        assert sorted(c.micro_dp for c in coords) == list(range(gen.d_g))
        # consecutive training TP ranks: the group's TP ranks form one block of r
        tps = sorted({gen.train.coords(r).tp for r in group})
        assert tps == list(range(tps[0], tps[0] + gen.r))
    dp_g = sorted(
        gen.coords(r).dp_g for r in range(world) if gen.coords(r).tp_g == 0 and gen.coords(r).pp_g == 0
    )
    assert dp_g == list(range(gen.d_g * gen.train.d))


def test_expert_parallel_groups_follow_megatrons_tp_ep_dp_pp_order():
    layout = ParallelLayout(p=2, t=2, d=4, ep=2)
    assert layout.coords(layout.rank_of(pp=1, dp=3, tp=1)).ep == 1
    assert layout.ep_groups()[:3] == [[0, 2], [1, 3], [4, 6]]  # consecutive DP ranks, per TP rank
    assert layout.expert_dp_groups()[:2] == [[0, 4], [1, 5]]  # same experts: DP stride ep
    assert sorted(r for g in layout.ep_groups() for r in g) == list(range(layout.world_size))
    assert str(layout) == "2-2-4 ep=2" and str(ParallelLayout(1, 1, 2)) == "1-1-2"
    with pytest.raises(ValueError, match="ep=3 must divide the data-parallel size d=4"):
        ParallelLayout(p=1, t=1, d=4, ep=3)


def _megatron_expert_groups(layout):
    """megatron-core's own expert rank generator (pure Python), as initialize_model_parallel builds it."""
    from megatron.core.parallel_state import RankGenerator

    gen = RankGenerator(
        tp=layout.expert_t,
        ep=layout.ep,
        dp=layout.expert_d,
        pp=layout.p,
        cp=1,
        order="tp-cp-ep-dp-pp",
        rank_offset=0,
    )
    return {axis: sorted(sorted(g) for g in gen.get_ranks(axis)) for axis in ("tp", "ep", "dp")}


@pytest.mark.parametrize(
    ("p", "t", "d", "ep", "etp"),
    [(1, 2, 2, 2, 1), (1, 2, 2, 4, 1), (2, 4, 2, 8, 1), (1, 4, 4, 2, 2), (2, 2, 4, 2, None), (1, 4, 8, 8, 1)],
)
def test_expert_groups_equal_megatrons_rank_generator(p, t, d, ep, etp):
    layout = ParallelLayout(p=p, t=t, d=d, ep=ep, etp=etp)
    ours = {
        "tp": sorted(sorted(g) for g in layout.expert_tp_groups()),
        "ep": sorted(sorted(g) for g in layout.ep_groups()),
        "dp": sorted(sorted(g) for g in layout.expert_dp_groups()),
    }
    assert ours == _megatron_expert_groups(layout)
    for rank in range(layout.world_size):  # coords name each rank's place in its groups
        c = layout.coords(rank)
        assert layout.expert_rank_of(pp=c.pp, edp=c.edp, ep=c.ep, etp=c.etp) == rank
        assert next(g for g in layout.ep_groups() if rank in g).index(rank) == c.ep
        assert next(g for g in layout.expert_tp_groups() if rank in g).index(rank) == c.etp


def test_etp_1_at_tp_2_makes_a_tp_group_an_ep_group():
    layout = ParallelLayout(p=1, t=2, d=2, ep=2, etp=1)
    assert [layout.coords(r).ep for r in range(4)] == [0, 1, 0, 1]
    assert layout.ep_groups() == [[0, 1], [2, 3]] == layout.tp_groups()
    assert layout.expert_dp_groups() == [[0, 2], [1, 3]] and layout.expert_d == 2
    assert str(layout) == "1-2-2 ep=2 etp=1"
    # etp = t is the default spelled out: the same layout, printed as before
    assert ParallelLayout(1, 2, 2, ep=2, etp=2) == ParallelLayout(1, 2, 2, ep=2)
    assert str(ParallelLayout(1, 2, 2, ep=2, etp=2)) == "1-2-2 ep=2"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"t": 2, "d": 2, "ep": 1, "etp": 4}, "etp=4 must divide the tensor size t=2"),
        ({"t": 4, "d": 1, "ep": 2, "etp": 3}, "etp=3 must divide the tensor size t=4"),
        ({"t": 2, "d": 1, "ep": 4, "etp": 1}, r"ep=4 x etp=1 must divide t x d = 2"),
        ({"t": 2, "d": 2, "ep": 2, "etp": 0}, "etp must be a positive integer"),
    ],
)
def test_expert_tensor_parallel_refusals(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ParallelLayout(p=1, **kwargs)


def _megatron_dense_groups(layout):
    """megatron-core's own decoder rank generator (pure Python), as initialize_model_parallel
    builds it with context_parallel_size: each group's ranks in megatron's order."""
    from megatron.core.parallel_state import RankGenerator

    gen = RankGenerator(
        tp=layout.t, ep=1, dp=layout.d, pp=layout.p, cp=layout.cp, order="tp-cp-ep-dp-pp", rank_offset=0
    )
    return {axis: sorted(gen.get_ranks(token)) for axis, token in DENSE_AXES.items()}


DENSE_AXES = {"tp": "tp", "cp": "cp", "dp": "dp", "dp_cp": "dp-cp", "pp": "pp", "mp": "tp-pp"}


@pytest.mark.parametrize(
    ("p", "t", "d", "cp"),
    [(1, 1, 1, 2), (1, 1, 2, 2), (1, 2, 1, 4), (2, 2, 2, 2), (2, 1, 3, 2), (1, 2, 2, 1)],
)
def test_context_parallel_groups_equal_megatrons_rank_generator(p, t, d, cp):
    layout = ParallelLayout(p=p, t=t, d=d, cp=cp)
    ours = {
        "tp": layout.tp_groups(),
        "cp": layout.cp_groups(),
        "dp": layout.dp_groups(),
        "dp_cp": layout.dp_cp_groups(),
        "pp": layout.pp_groups(),
        "mp": layout.model_parallel_groups(),
    }
    # each group's member order and sizes as megatron's (the lists of groups sorted)
    assert {axis: sorted(groups) for axis, groups in ours.items()} == _megatron_dense_groups(layout)
    assert layout.world_size == p * t * d * cp
    for rank in range(layout.world_size):
        c = layout.coords(rank)
        assert layout.rank_of(pp=c.pp, dp=c.dp, tp=c.tp, cp=c.cp) == rank
        assert next(g for g in layout.cp_groups() if rank in g).index(rank) == c.cp
        assert next(g for g in layout.dp_groups() if rank in g).index(rank) == c.dp


def test_cp_ranks_are_data_replicas_for_the_weights():
    layout = ParallelLayout(p=2, t=2, d=2, cp=2)
    flat = layout.as_data_replicas()
    assert (flat.p, flat.t, flat.d, flat.cp) == (2, 2, 4, 1) and str(layout) == "2-2-2 cp=2"
    for rank in range(layout.world_size):  # the same weight shard: the same (pp, tp)
        a, b = layout.coords(rank), flat.coords(rank)
        assert (a.pp, a.tp, a.cp + layout.cp * a.dp) == (b.pp, b.tp, b.dp)
    gen = GenerationLayout.from_training(layout, t_g=1)
    assert gen.train == flat and gen.world_size == layout.world_size
    with pytest.raises(ValueError, match="build it from_training"):
        GenerationLayout(train=layout, t_g=1, p_g=1)
    with pytest.raises(ValueError, match="experts under context parallelism are not built"):
        ParallelLayout(p=1, t=1, d=2, ep=2, cp=2)
    with pytest.raises(ValueError, match="cp must be a positive integer"):
        ParallelLayout(p=1, t=1, d=1, cp=0)
