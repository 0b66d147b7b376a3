"""`actor.parallel.ep` and `actor.moe.*`: typed, checked against the model, naming their keys."""

from pathlib import Path

import pytest

from rl3d.config import ConfigError, load_config
from rl3d.config.moe import MoeConfig
from rl3d.config.pools import role_pools

ROOT = Path(__file__).resolve().parents[3]
GRPO = ROOT / "recipes/quickstart_cpu_grpo.yaml"
MOE = ["model.name=tiny-qwen3-moe", "actor.parallel={tp: 1, pp: 1, dp: 2, ep: 2}"]


def test_defaults_keep_a_dense_run_as_it_was():
    cfg = load_config(GRPO).config
    assert cfg.actor.parallel.ep == 1 and role_pools(cfg)[0].layout.ep == 1
    assert cfg.actor.moe == MoeConfig() and cfg.actor.moe.transformer_overrides() == {}


def test_ep_reaches_the_actor_layout_and_the_router_losses_megatron():
    cfg = load_config(GRPO, [*MOE, "actor.moe.aux_loss_coef=0.01", "actor.moe.z_loss_coef=0.001"]).config
    layout = role_pools(cfg)[0].layout
    assert (layout.p, layout.t, layout.d, layout.ep) == (1, 1, 2, 2)
    assert cfg.actor.moe.transformer_overrides() == {"moe_aux_loss_coeff": 0.01, "moe_z_loss_coeff": 0.001}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["actor.parallel={tp: 1, pp: 1, dp: 2, ep: 2}"], r"actor\.parallel\.ep: ep=2: tiny-llama is dense"),
        (
            [
                "model.name=tiny-qwen3-moe",
                "actor.parallel={tp: 1, pp: 1, dp: 3, ep: 3}",
                "launch.nproc_per_node=3",
            ],
            r"actor\.parallel\.ep: ep=3 must divide the model's 8 experts",
        ),
        (
            ["model.name=tiny-qwen3-moe", "actor.parallel={tp: 1, pp: 1, dp: 2, ep: 4}"],
            r"actor\.parallel\.ep: ep=4 must divide dp=2",
        ),
        ([*MOE, "actor.moe.aux_loss_coef=-1"], r"actor\.moe\.aux_loss_coef: must be a number >= 0"),
        (
            ["model.name=tiny-qwen3-moe", "actor.parallel={tp: 2, pp: 1, dp: 1, sequence_parallel: false}"],
            r"actor\.parallel\.sequence_parallel: false: training a mixture of experts .* needs sequence "
            r"parallelism",
        ),
        (
            ["model.name=tiny-qwen3-moe", "actor.parallel={tp: 2, pp: 1, dp: 1}", "actor.lora.rank=4"],
            r"actor\.lora: does not run with sequence parallelism \(actor\.parallel\.tp=2",
        ),
        (
            ["actor.parallel={tp: 2, pp: 1, dp: 1, sequence_parallel: yes please}"],
            r"actor\.parallel\.sequence_parallel: expected bool or one of 'auto'",
        ),
    ],
    ids=["dense", "experts", "dp", "negative-coef", "sp-off", "sp-lora", "sp-value"],
)
def test_bad_keys_are_named(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(GRPO, overrides)


def test_tp_times_ep_loads_with_sequence_parallelism_auto():
    """A mixture of experts at tp 2 x ep 2 (4 ranks) is a valid recipe; `auto` resolves to
    sequence parallelism for it and to none for the dense demo at tp 2."""
    from rl3d.models.sequence_parallel import resolve_sequence_parallel
    from rl3d.models.spec import get_model_spec

    over = [
        "model.name=tiny-qwen3-moe",
        "actor.parallel={tp: 2, pp: 1, dp: 2, ep: 2}",
        "launch.nproc_per_node=4",
    ]
    cfg = load_config(GRPO, over).config
    par = cfg.actor.parallel
    assert (par.tp, par.ep, par.sequence_parallel) == (2, 2, "auto")
    assert resolve_sequence_parallel(par.sequence_parallel, is_moe=True, tp=par.tp)
    dense = load_config(GRPO).config.actor.parallel  # the demo: tiny Llama at tp 2
    assert dense.tp == 2 and not resolve_sequence_parallel(dense.sequence_parallel, is_moe=False, tp=2)
    assert get_model_spec("tiny-qwen3-moe").is_moe
