"""The mechanism model on the paper's layouts: node-link bytes, the lower bound, each
baseline's calls and peak, and the transition hidden behind the optimizer step."""

import json

import pytest

from rl3d.bench.modeled import FIG14_LAYOUTS, Point, model_point, overlapped_seconds, run_modeled
from rl3d.cli import main
from rl3d.costs.cluster import Cluster

STRATEGIES = {"hybridflow", "hybridflow_v", "ds_chat", "openrlhf", "verl_2024", "hybridflow_overlap"}


@pytest.fixture(scope="module")
def fig14():
    return run_modeled(list(FIG14_LAYOUTS), Cluster(), paper_layouts=True)


@pytest.fixture(scope="module")
def p70():
    return model_point(Point("llama2-70b", 8, 8, 2, 8, 1))


def test_paper_layouts_points_and_contract(capsys, tmp_path):
    args = ["bench", "transition", "--mode", "modeled", "--paper-layouts", "--json", "--out", str(tmp_path)]
    assert main([*args, "--models", "llama2-34b,llama2-70b"]) == 0
    out = json.loads(capsys.readouterr().out)
    got = [(p["model"], p["gpus"], p["train"]["t"], p["train"]["p"], p["gen"]["t_g"]) for p in out["points"]]
    assert got == [
        ("llama2-34b", 32, 8, 4, 8),
        ("llama2-34b", 64, 8, 4, 8),
        ("llama2-34b", 128, 8, 4, 8),
        ("llama2-70b", 64, 8, 8, 8),
        ("llama2-70b", 128, 8, 8, 8),
    ]
    for point in out["points"]:
        assert set(point) == {"model", "gpus", "train", "gen", "lower_bound_seconds", "strategies"}
        assert set(point["strategies"]) == STRATEGIES
        for s in point["strategies"].values():
            assert set(s) == {"seconds", "bytes_max", "node_bytes_max", "calls", "peak_param_bytes"}
    for name in ("transition.csv", "transition.png", "transition.md"):
        assert (tmp_path / name).stat().st_size > 0


def test_fig14_sweep_gpu_counts(fig14):
    counts = {}
    for p in fig14["points"]:
        counts.setdefault(p["model"], []).append(p["gpus"])
    assert counts == {
        "llama2-7b": [8, 16, 32, 64, 128],
        "llama2-13b": [8, 16, 32, 64, 128],
        "llama2-34b": [32, 64, 128],
        "llama2-70b": [64, 128],
    }


def test_hybridflow_sits_on_the_lower_bound_and_overlap_hides_part(fig14):
    for p in fig14["points"]:
        st, bound = p["strategies"], p["lower_bound_seconds"]
        assert bound <= st["hybridflow"]["seconds"] <= 1.1 * bound, (p["model"], p["gpus"])
        assert st["hybridflow_overlap"]["seconds"] <= st["hybridflow"]["seconds"]
        for base in ("hybridflow_v", "ds_chat", "openrlhf", "verl_2024"):
            assert st[base]["seconds"] >= bound
        if p["model"] in ("llama2-7b", "llama2-13b"):  # the optimizer step outlasts most of the transfer
            assert st["hybridflow_overlap"]["seconds"] < bound


def test_70b_node_link_bytes_and_bound(p70):
    m = p70["model_bytes"]
    lb = p70["lower_bound"]
    assert lb["node_bytes"] == pytest.approx(7 / 8 * m, rel=2e-3)  # each node lacks 7 of 8 stages
    assert p70["lower_bound_seconds"] == pytest.approx(lb["node_bytes"] / 25e9)
    st = p70["strategies"]
    assert st["hybridflow"]["node_bytes_max"] == pytest.approx(7 / 8 * m, rel=2e-3)
    # a 64-rank ring ordered node by node re-enters each node with all but one member's pieces
    assert st["hybridflow_v"]["node_bytes_max"] == pytest.approx(63 / 64 * m, rel=2e-3)
    per_gpu = Cluster(nics_per_node=8)
    assert model_point(Point("llama2-70b", 8, 8, 2, 8, 1), per_gpu)["lower_bound_seconds"] == pytest.approx(
        p70["lower_bound_seconds"] / 8
    )


def test_70b_baseline_mechanisms(p70):
    m, st = p70["model_bytes"], p70["strategies"]
    assert st["ds_chat"]["calls"] == 723  # one ZeRO-3 all-gather per HF tensor: 80 x 9 + 3
    assert st["openrlhf"]["calls"] == 2 * 723  # gather, then broadcast to vLLM, per tensor
    layer = (m - 2 * 32000 * 8192 * 2) / 80
    expected = m / 8 + 8 * layer + m / 128  # inference shard + one 8-layer group + ZeRO-3 partition
    assert st["ds_chat"]["peak_param_bytes"] == pytest.approx(expected, rel=2e-3)
    assert st["ds_chat"]["peak_param_bytes"] < m / 4
    verl = st["verl_2024"]
    assert verl["calls"] == 8  # one broadcast per stage; t_g = t, so no TP gathers
    reload = verl["terms"]["reload_cpu_to_gpu"]
    assert reload == pytest.approx(7 / 64 * m / 32e9, rel=0.02)
    assert st["openrlhf"]["latency_seconds"] > 1.0 and st["hybridflow"]["latency_seconds"] < 0.01


def test_overlap_model_by_hand():
    # transfer faster than the update: only the last bucket is left after the step
    assert overlapped_seconds(1.0, 10, 5.0) == pytest.approx(0.1)
    # transfer slower: what the step cannot cover, plus the wait for the first bucket
    assert overlapped_seconds(4.0, 4, 2.0) == pytest.approx(0.5 + 4.0 - 2.0)
    assert overlapped_seconds(1.0, 1, 0.0) == pytest.approx(1.0)
