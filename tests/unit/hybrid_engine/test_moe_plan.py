"""A mixture of experts' transition by weight class: experts and dense weights planned apart add up
to the whole plan on every rank, and `rl3d plan` prints and writes both."""

import json
import subprocess
import sys

import pytest

from rl3d.hybrid_engine.moe_plan import plan_moe_split
from rl3d.hybrid_engine.plan import plan_transition
from rl3d.models.params import model_params
from rl3d.models.spec import get_model_spec
from rl3d.parallel import ParallelLayout


@pytest.mark.parametrize(
    ("name", "train", "t_g"),
    [
        ("tiny-qwen3-moe", ParallelLayout(1, 2, 2), 1),
        ("tiny-qwen2-moe", ParallelLayout(2, 2, 1), 1),
        ("tiny-glm4-moe", ParallelLayout(2, 2, 1), 2),  # a dense first layer, the routers' biases
        ("tiny-deepseek-v3", ParallelLayout(2, 2, 1), 2),  # and MLA's column-parallel projections
        ("qwen3-30b-a3b", ParallelLayout(1, 8, 2), 4),
    ],
)
def test_expert_and_dense_bytes_add_up_to_the_plan_on_every_rank(name, train, t_g):
    spec = get_model_spec(name)
    params = model_params(spec, train_tp=train.t)
    whole = plan_transition(spec, train, t_g, strategies=("hybridflow",)).strategies["hybridflow"]
    parts = [
        plan_transition(spec, train, t_g, strategies=("hybridflow",), params=subset).strategies["hybridflow"]
        for subset in ([p for p in params if p.expert is not None], [p for p in params if p.expert is None])
    ]
    for rank, cost in enumerate(whole.ranks):
        assert cost.recv_bytes == sum(part.ranks[rank].recv_bytes for part in parts), rank
    split = plan_moe_split(spec, train, t_g)
    experts, dense = split["experts"], split["dense"]
    assert experts["model_bytes"] + dense["model_bytes"] == 2 * sum(
        p.numel for p in params if not p.tied_copy
    )
    assert experts["recv_max"] > dense["recv_max"] > 0  # most of a MoE's weights are its experts
    assert experts["recv_max"] + dense["recv_max"] >= whole.comm_bytes_max


def test_dense_models_have_no_split_and_the_cli_reports_it():
    with pytest.raises(ValueError, match="has no experts"):
        plan_moe_split(get_model_spec("tiny-llama"), ParallelLayout(1, 2, 1), 1)
    cmd = [sys.executable, "-m", "rl3d.cli", "plan", "--model", "qwen3-30b-a3b", "--train", "1,8,2"]
    out = subprocess.run([*cmd, "--gen", "4,1", "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    moe = json.loads(out.stdout)["moe"]
    assert moe["experts"]["recv_max"] > 10 * moe["dense"]["recv_max"]
    text = subprocess.run([*cmd, "--gen", "4,1"], capture_output=True, text=True, timeout=120).stdout
    assert "mixture of experts: the transition by weight class" in text
