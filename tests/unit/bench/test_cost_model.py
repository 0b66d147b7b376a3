"""The alpha-beta model, by hand: NVLink rings, shared NICs, and the constant fit."""

import json

import pytest

from rl3d.bench.cost_model import concurrent_ring_seconds, fit_alpha_beta, strategy_seconds
from rl3d.cli import main
from rl3d.costs.cluster import Cluster
from rl3d.hybrid_engine.plan import plan_transition
from rl3d.models.spec import get_model_spec
from rl3d.parallel import ParallelLayout

CLUSTER = Cluster(gpus_per_node=8, nvlink_gbps=300.0, nic_gbps=25.0, nics_per_node=1, alpha_us=10.0)


def test_ring_inside_a_node_runs_at_nvlink_speed():
    seconds = concurrent_ring_seconds([[0, 1, 2, 3]], {0: 3e9, 1: 3e9, 2: 3e9, 3: 3e9}, CLUSTER)
    assert seconds == pytest.approx(3 * 10e-6 + 3e9 / 300e9)


def test_rings_leaving_a_node_share_its_nic():
    # 8 groups, each taking one GPU from node 0 and one from node 1: 8 hops leave each node.
    groups = [[i, 8 + i] for i in range(8)]
    recv = {r: 1e9 for g in groups for r in g}
    assert concurrent_ring_seconds(groups, recv, CLUSTER) == pytest.approx(10e-6 + 1e9 / (25e9 / 8))
    # one such group alone has the whole NIC
    assert concurrent_ring_seconds(groups[:1], recv, CLUSTER) == pytest.approx(10e-6 + 1e9 / 25e9)


def test_hybridflow_inside_node_beats_baselines():
    plan = plan_transition(get_model_spec("llama2-7b"), ParallelLayout(1, 8, 2), 2, 1)
    hf = strategy_seconds(plan, "hybridflow", CLUSTER)
    assert hf < strategy_seconds(plan, "hybridflow_v", CLUSTER) < strategy_seconds(plan, "ds_chat", CLUSTER)
    # micro-DP groups of 4 inside a node: NVLink time of its own received bytes
    recv = plan.strategies["hybridflow"].comm_bytes_max
    assert hf == pytest.approx(3 * 10e-6 + recv / 300e9, rel=1e-6)


def test_fit_recovers_alpha_and_bandwidth():
    alpha, bandwidth = 50e-6, 2e9
    samples = [(steps, b, steps * alpha + b / bandwidth) for steps in (1, 3, 7) for b in (1e3, 1e6, 1e8)]
    fa, fb, r2 = fit_alpha_beta(samples)
    assert fa == pytest.approx(alpha, rel=1e-6) and fb == pytest.approx(bandwidth, rel=1e-6) and r2 > 0.999


def test_modeled_json_contract(capsys, tmp_path):
    assert main(["bench", "transition", "--mode", "modeled", "--json", "--out", str(tmp_path)]) == 0
    out = json.loads(capsys.readouterr().out)
    points = out["points"]
    assert [p["model"] for p in points] == ["llama2-7b", "llama2-13b", "llama2-34b", "llama2-70b"]
    for point in points:
        assert {"t", "p", "d"} == set(point["train"]) and {"t_g", "p_g", "d_g"} == set(point["gen"])
        for name in ("hybridflow", "hybridflow_v", "ds_chat", "openrlhf", "verl_2024", "hybridflow_overlap"):
            s = point["strategies"][name]
            assert isinstance(s["bytes_max"], int) and s["seconds"] > 0
        assert point["strategies"]["hybridflow"]["seconds"] < point["strategies"]["openrlhf"]["seconds"]
    for name in ("transition.csv", "transition.png", "transition.md", "result.json"):
        assert (tmp_path / name).stat().st_size > 0
    assert "paper: 55.2%" in (tmp_path / "transition.md").read_text()


def test_modeled_rejects_unknown_model(capsys):
    assert main(["bench", "transition", "--mode", "modeled", "--models", "llama2-8b"]) == 2
    assert "no paper layout for 'llama2-8b'" in capsys.readouterr().err
