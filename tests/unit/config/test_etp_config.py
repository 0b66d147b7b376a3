"""`actor.parallel.etp`: the default keeps expert TP = tp; a set value reaches the layout; each
refusal names the key."""

from pathlib import Path

import pytest

from rl3d.config import ConfigError, load_config
from rl3d.config.pools import role_pools
from rl3d.parallel.layout import ParallelLayout

ROOT = Path(__file__).resolve().parents[3]
GRPO = ROOT / "recipes/quickstart_cpu_grpo.yaml"
MOE = "model.name=tiny-qwen3-moe"


def test_default_is_tp():
    cfg = load_config(
        GRPO, [MOE, "actor.parallel={tp: 2, pp: 1, dp: 2, ep: 2}", "launch.nproc_per_node=4"]
    ).config
    layout = role_pools(cfg)[0].layout
    assert cfg.actor.parallel.etp is None and layout == ParallelLayout(1, 2, 2, ep=2)
    assert layout.expert_t == 2 and str(layout) == "1-2-2 ep=2"


def test_etp_reaches_the_layout():
    par = "actor.parallel={tp: 2, pp: 1, dp: 2, ep: 2, etp: 1}"
    layout = role_pools(load_config(GRPO, [MOE, par, "launch.nproc_per_node=4"]).config)[0].layout
    assert (layout.t, layout.d, layout.ep, layout.expert_t, layout.expert_d) == (2, 2, 2, 1, 2)


@pytest.mark.parametrize(
    ("parallel", "model", "message"),
    [
        ("{tp: 2, pp: 1, dp: 2, ep: 2, etp: 4}", MOE, r"actor\.parallel\.etp: etp=4 must divide tp=2"),
        (
            "{tp: 2, pp: 1, dp: 1, ep: 4, etp: 1}",
            MOE,
            r"actor\.parallel\.etp: ep x etp = 4 x 1 must divide tp x dp",
        ),
        ("{tp: 2, pp: 1, dp: 2, ep: 2, etp: 0}", MOE, r"actor\.parallel\.etp: must be > 0"),
        ("{tp: 2, pp: 1, dp: 2, etp: 1}", MOE, r"actor\.parallel\.etp: etp=1 apart from tp=2 needs ep > 1"),
    ],
    ids=["divides-tp", "divides-world", "positive", "ep-1"],
)
def test_refusals_name_the_key(parallel, model, message):
    model_key = model if model.startswith("model.") else f"model.name={model}"
    with pytest.raises(ConfigError, match=message):
        load_config(GRPO, [model_key, f"actor.parallel={parallel}", "launch.nproc_per_node=4"])


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("hybrid_engine.strategy=ds_chat", r"hybrid_engine\.strategy: ds_chat: .* hybridflow only"),
    ],
    ids=["strategy"],
)
def test_the_transition_it_does_not_plan_is_refused_at_validate(override, message):
    par = "actor.parallel={tp: 2, pp: 1, dp: 2, ep: 2, etp: 1}"
    with pytest.raises(ConfigError, match=message):
        load_config(GRPO, [MOE, par, "launch.nproc_per_node=4", override])


def test_generation_tp_above_the_expert_tp_validates():
    par = "actor.parallel={tp: 2, pp: 1, dp: 2, ep: 2, etp: 1}"
    cfg = load_config(GRPO, [MOE, par, "launch.nproc_per_node=4", "rollout.t_g=2"]).config
    assert (cfg.actor.parallel.etp, cfg.rollout.t_g) == (1, 2)
