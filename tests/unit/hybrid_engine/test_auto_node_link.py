"""`rl3d plan --auto` charges a node's network link once for all of its GPUs."""

import pytest

from rl3d.hybrid_engine.auto import HardwareModel, best_row, link_seconds, search_layouts
from rl3d.models.spec import get_model_spec
from rl3d.parallel import ParallelLayout

HW = HardwareModel()


def _rows(batch: int):
    spec = get_model_spec("llama2-70b")
    return search_layouts(
        spec, ParallelLayout(8, 8, 2), batch=batch, prompt_len=1024, response_len=1024, hw=HW
    )


def test_link_seconds_by_hand():
    # 8 rings, each with one GPU in node 0 and one in node 1: both nodes' links carry 8 GB
    groups = [[i, 8 + i] for i in range(8)]
    assert link_seconds(groups, {r: 10**9 for g in groups for r in g}, HW) == pytest.approx(8e9 / 25e9)
    # inside one node: each GPU's NVLink
    assert link_seconds([[0, 1, 2, 3]], dict.fromkeys(range(4), 3 * 10**9), HW) == pytest.approx(3e9 / 300e9)


def test_70b_transition_is_the_node_link_time():
    row = next(r for r in _rows(1024) if (r.t_g, r.p_g) == (8, 1))
    # each node pulls 7/8 of the model (8 GPUs x 7/64 M) through one 25 GB/s link: about 4.8 s
    assert row.transition_s == pytest.approx(8 * row.transition_bytes / 25e9, rel=1e-3)
    assert 4.7 < row.transition_s < 5.0


def test_auto_choice_changes_where_the_old_estimate_was_wrong():
    rows = [r for r in _rows(256) if r.fits]
    best = best_row(rows)
    assert (best.t_g, best.p_g) == (8, 2)  # micro-DP groups over 4 stages instead of 8

    def old_total(r):  # before: one GPU's bytes over the whole node link
        return r.transition_bytes / 25e9 + (HW.alpha_us * 1e-6 if r.d_g > 1 else 0) + r.generate_s

    old = min(rows, key=old_total)
    assert (old.t_g, old.p_g) == (8, 1)
    assert best.total_s < next(r for r in rows if (r.t_g, r.p_g) == (8, 1)).total_s
