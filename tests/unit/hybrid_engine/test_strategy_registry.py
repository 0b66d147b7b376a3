"""The strategy registry: production registers only hybridflow, the benchmark adds its
baselines, and a plan's per-rank bytes are the traffic of its own collectives."""

import subprocess
import sys

import pytest

from rl3d.hybrid_engine import STRATEGIES, get_strategy, plan_transition
from rl3d.models.spec import get_model_spec
from rl3d.parallel import ParallelLayout


def _run(code: str) -> list[str]:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().splitlines()


def test_production_registers_only_hybridflow_and_bench_adds_the_baselines_without_torch():
    lines = _run(
        "import sys; from rl3d.hybrid_engine import STRATEGIES; print(list(STRATEGIES)); "
        "import rl3d.bench; print(list(STRATEGIES)); print('torch' in sys.modules)"
    )
    assert lines == [
        "['hybridflow']",
        "['hybridflow', 'hybridflow_v', 'ds_chat', 'openrlhf', 'hybridflow_hier']",
        "False",
    ]


def test_unknown_strategy_names_the_known_ones():
    with pytest.raises(ValueError, match="unknown strategy 'zero'; known: (.*, )?hybridflow"):
        get_strategy("zero")


@pytest.mark.parametrize(
    "model, train, t_g, p_g",
    [("tiny-llama", (2, 2, 2), 2, 1), ("tiny-qwen2", (2, 2, 1), 1, 1), ("llama2-7b", (2, 4, 2), 2, 2)],
)
def test_rank_bytes_are_the_traffic_of_the_plans_collectives(model, train, t_g, p_g):
    import rl3d.bench  # noqa: F401

    plan = plan_transition(get_model_spec(model), ParallelLayout(*train), t_g, p_g)
    assert list(plan.strategies) == list(STRATEGIES)
    for s in plan.strategies.values():
        recv, send = plan._ctx.traffic(s.collectives, s.phases)
        assert {r.rank: (r.recv_bytes, r.send_bytes) for r in s.ranks} == {
            r.rank: (recv[r.rank], send[r.rank]) for r in s.ranks
        }, s.strategy
        for c in s.collectives:  # every rank of a collective appears in exactly one of its groups
            members = [m for g in c.groups for m in g]
            assert len(members) == len(set(members)) and all(c.group_of(m) for m in members)
