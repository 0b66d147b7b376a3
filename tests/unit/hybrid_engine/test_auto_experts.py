"""`rl3d plan --auto` times the experts moved apart from the dense weights with the same links."""

import functools
from dataclasses import replace

import pytest

from rl3d.hybrid_engine.auto import (
    HardwareModel,
    dense_seconds,
    expert_seconds,
    link_seconds,
    search_layouts,
)
from rl3d.hybrid_engine.moe_plan import plan_moe_split
from rl3d.hybrid_engine.plan import plan_transition
from rl3d.models.spec import get_model_spec
from rl3d.parallel import ParallelLayout

HW = HardwareModel()
ALPHA = HW.alpha_us * 1e-6
# Qwen3-30B-A3B's widths and 128 experts on 4 layers: the same per-layer traffic, planned fast
QWEN = replace(get_model_spec("qwen3-30b-a3b"), num_layers=4)


@functools.cache
def _expert_recv(train: ParallelLayout, t_g: int) -> int:
    """Bytes of experts a rank receives, from the experts-only plan (every rank the same here)."""
    split = plan_moe_split(QWEN, train, t_g)["experts"]
    assert split["recv_max"] == split["recv_mean"] > 0
    return split["recv_max"]


@functools.cache
def _rows(train: ParallelLayout, hw: HardwareModel):
    return search_layouts(QWEN, train, batch=256, prompt_len=1024, response_len=1024, hw=hw)


def _row(train: ParallelLayout, t_g: int, hw: HardwareModel = HW):
    return next(r for r in _rows(train, hw) if (r.t_g, r.p_g) == (t_g, 1))


def test_ep_all_gather_is_the_node_links_time():
    # ep 8 over the data-parallel ranks (stride t = 4): each EP group's ring crosses the 4 nodes,
    # one hop into each node; the 4 EP groups (one per TP rank) enter every node at once
    train = ParallelLayout(1, 4, 8, ep=8)
    plan = plan_transition(QWEN, train, 4, strategies=("hybridflow",))
    recv = _expert_recv(train, 4)
    assert expert_seconds(plan, HW) == pytest.approx(4 * recv / 25e9 + ALPHA, rel=1e-9)
    row = _row(train, 4)
    assert dense_seconds(plan, HW) == 0.0  # identity for the dense weights (d_g = 1)
    assert row.transition_s == pytest.approx(4 * recv / 25e9 + ALPHA, rel=1e-9)


def test_expert_parts_point_to_point_inside_a_node():
    # etp 1 apart from tp 4: the 8 EP ranks of one expert-DP index are one node, so every part
    # moves over NVLink; each GPU receives (and sends) its share once
    train = ParallelLayout(1, 4, 8, ep=8, etp=1)
    plan = plan_transition(QWEN, train, 4, strategies=("hybridflow",))
    assert plan.strategies["hybridflow"].phases and not plan.strategies["hybridflow"].collectives
    recv = _expert_recv(train, 4)
    assert _row(train, 4).transition_s == pytest.approx(recv / 300e9 + ALPHA, rel=1e-9)


def test_expert_parts_point_to_point_across_nodes():
    # 4 GPUs per node: a rank gets 4 of its 7 senders' equal shares from the other node, so a
    # node's link carries 4 ranks x 4/7 of a rank's expert bytes
    hw = HardwareModel(gpus_per_node=4)
    train = ParallelLayout(1, 4, 8, ep=8, etp=1)
    plan = plan_transition(QWEN, train, 4, strategies=("hybridflow",))
    recv = _expert_recv(train, 4)
    expected = 16 / 7 * recv / 25e9 + ALPHA
    assert expert_seconds(plan, hw) == pytest.approx(expected, rel=1e-9)
    assert _row(train, 4, hw).transition_s == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("t_g", [1, 2])
@pytest.mark.parametrize("etp", [None, 1])
def test_experts_add_to_the_dense_time(t_g, etp):
    train = ParallelLayout(1, 4, 8, ep=8, etp=etp)
    plan = plan_transition(QWEN, train, t_g, strategies=("hybridflow",))
    dense, experts = dense_seconds(plan, HW), expert_seconds(plan, HW)
    assert experts > ALPHA and dense > ALPHA
    assert _row(train, t_g).transition_s == pytest.approx(dense + experts, rel=1e-12)
    # experts over their own rings or messages are at least their bytes over the fastest link
    assert experts >= _expert_recv(train, t_g) / 300e9


@pytest.mark.parametrize(("model", "train"), [("llama2-7b", (2, 4, 8)), ("llama2-70b", (4, 8, 4))])
def test_dense_time_is_the_micro_dp_rings(model, train):
    """A dense model's time: every byte a rank receives over its micro-DP ring, as it always was."""
    spec, layout = get_model_spec(model), ParallelLayout(*train)
    rows = search_layouts(spec, layout, batch=64, prompt_len=512, response_len=512, hw=HW)
    assert len(rows) > 2
    for row in rows:
        plan = plan_transition(spec, layout, row.t_g, row.p_g, strategies=("hybridflow",))
        recv = {r.rank: r.recv_bytes for r in plan.strategies["hybridflow"].ranks}
        old = link_seconds(plan.gen.micro_dp_groups(), recv, HW) + (ALPHA if row.d_g > 1 else 0)
        assert row.transition_s == old
        assert expert_seconds(plan, HW) == 0.0


def test_expert_tp_apart_needs_expert_parallelism():
    # at ep 1 the experts would ride the dense all-gather and move again point to point
    with pytest.raises(ValueError, match=r"etp=1 apart from tp=4 needs ep > 1"):
        plan_transition(QWEN, ParallelLayout(1, 4, 8, ep=1, etp=1), 2)
