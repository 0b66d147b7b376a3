"""Every registered policy loss composes with rollout correction, the aggregations, the entropy
bonus and the KL term as PPO's does; presets are the papers' values and a recipe's own value
wins; a hyperparameter a loss does not take, or an aggregation its objective forbids, is refused
naming the key; padding never changes a result."""

import math
from pathlib import Path

import pytest
import torch

from rl3d import algos
from rl3d.algos import policy_loss_of
from rl3d.algos.core import aggregate_loss
from rl3d.algos.kl import kl_k3
from rl3d.config import AlgorithmConfig
from rl3d.config.errors import ConfigError, FieldError
from rl3d.config.policy_loss import PolicyLossParams
from rl3d.config.schema import RolloutCorrectionConfig

SEQ = "seq-mean-token-mean"
NEW = ("gspo", "gmpo", "sapo", "cispo", "gpg", "clip_cov", "kl_cov")
SEQUENCE_LEVEL = ("gspo", "gmpo")


def _agg(name):
    return SEQ if name in SEQUENCE_LEVEL else "token-mean"


def _inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    B, T = 4, 6
    logp = torch.randn(B, T, generator=gen, dtype=torch.float64) * 0.3 - 1.5
    mask = torch.arange(T)[None, :] < torch.tensor([6, 3, 5, 1])[:, None]
    return {
        "logp_BT": logp,
        "old_logp_BT": logp + torch.randn(B, T, generator=gen, dtype=torch.float64) * 1e-3,
        "adv_BT": torch.tensor([1.0, -0.5, 2.0, -1.5], dtype=torch.float64)[:, None].expand(B, T).clone(),
        "mask_BT": mask,
    }


def _call(fn, x, seed=0, **kwargs):
    torch.manual_seed(seed)  # Clip-Cov's draw
    logp = x["logp_BT"].clone().requires_grad_(True)
    loss, metrics = fn(**{**x, "logp_BT": logp}, **kwargs)
    loss.backward()
    return loss.detach(), metrics, logp.grad


@pytest.mark.parametrize("name", NEW)
def test_rollout_correction_scales_each_token_as_with_ppo(name):
    x = _inputs()
    rollout = x["old_logp_BT"] - torch.linspace(-1.0, 1.0, 24, dtype=torch.float64).view(4, 6)
    cfg = AlgorithmConfig(policy_loss=name, loss_agg_mode=_agg(name))
    corrected = AlgorithmConfig(
        policy_loss=name, loss_agg_mode=_agg(name), rollout_correction=RolloutCorrectionConfig(mode="tis")
    )
    weights_BT, _, _ = algos.rollout_correction.rollout_weights(
        x["old_logp_BT"], rollout, x["mask_BT"], mode="tis", threshold=2.0
    )
    loss, metrics, grad = _call(policy_loss_of(corrected), x, rollout_logp_BT=rollout)
    want, _, want_grad = _call(policy_loss_of(cfg), x, weights_BT=weights_BT)
    torch.testing.assert_close(loss, want, rtol=0, atol=0)
    torch.testing.assert_close(grad, want_grad, rtol=0, atol=0)
    assert {"rollout/kl_k3", "rollout_corr/weight_mean"} <= set(metrics)
    plain, _, _ = _call(policy_loss_of(cfg), x)
    assert not torch.equal(loss, plain)


@pytest.mark.parametrize("name", NEW)
def test_entropy_bonus_and_kl_term_add_as_with_ppo(name):
    x = _inputs(1)
    entropy = torch.rand(4, 6, dtype=torch.float64) * 3
    ref = x["logp_BT"] + 0.2
    fn, agg = algos.get_policy_loss(name), _agg(name)
    base, _, _ = _call(fn, x, loss_agg_mode=agg)
    full, metrics, _ = _call(
        fn, x, loss_agg_mode=agg, entropy_BT=entropy, entropy_coef=0.01, ref_logp_BT=ref, kl_loss_coef=0.1
    )
    kl = aggregate_loss(kl_k3(x["logp_BT"], ref), x["mask_BT"], mode=agg)
    want = base - 0.01 * aggregate_loss(entropy, x["mask_BT"], mode=agg) + 0.1 * kl
    torch.testing.assert_close(full, want, rtol=1e-12, atol=1e-12)
    assert metrics["kl_loss"].item() == pytest.approx(kl.item())
    assert {"pg_loss", "approx_kl", "adv_mean", "adv_std", "entropy"} <= set(metrics)


@pytest.mark.parametrize("name", [n for n in NEW if n not in SEQUENCE_LEVEL])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum", SEQ])
def test_token_level_losses_take_every_aggregation(name, agg):
    x = _inputs(2)
    loss, _, _ = _call(algos.get_policy_loss(name), x, loss_agg_mode=agg)
    assert torch.isfinite(loss)


@pytest.mark.parametrize("name", SEQUENCE_LEVEL)
def test_sequence_level_losses_refuse_token_aggregation(name):
    with pytest.raises(ValueError, match="sequence-level"):
        _call(algos.get_policy_loss(name), _inputs(), loss_agg_mode="token-mean")
    with pytest.raises(FieldError, match="loss_agg_mode: policy_loss .* sequence-level"):
        AlgorithmConfig(policy_loss=name)
    AlgorithmConfig(policy_loss=name, loss_agg_mode=SEQ)


@pytest.mark.parametrize(
    ("name", "settings", "key"),
    [
        ("gpg", {"clip_low": 0.2}, "clip_low"),
        ("kl_cov", {"clip_high": 0.3}, "clip_high"),
        ("sapo", {"dual_clip_c": 3.0}, "dual_clip_c"),
        ("gspo", {"loss_agg_mode": SEQ, "dual_clip_c": 3.0}, "dual_clip_c"),
        ("ppo", {"loss_params": PolicyLossParams(tau_pos=2.0)}, "loss_params.tau_pos"),
        ("clip_cov", {"loss_params": PolicyLossParams(kl_cov_coef=0.5)}, "loss_params.kl_cov_coef"),
    ],
)
def test_a_key_the_loss_does_not_take_is_refused_by_name(name, settings, key):
    with pytest.raises(FieldError) as info:
        AlgorithmConfig(policy_loss=name, **settings)
    assert info.value.field == key and name in str(info.value)


def test_the_typed_loader_names_the_full_key():
    from rl3d.config import load_config

    recipe = Path(__file__).resolve().parents[3] / "recipes/quickstart_cpu_grpo.yaml"
    overrides = ["algorithm.policy_loss=sapo", "algorithm.loss_params.cov_lb=2.0"]
    with pytest.raises(ConfigError, match=r"algorithm\.loss_params\.cov_lb: policy_loss 'sapo' has no"):
        load_config(recipe, overrides)


def test_presets_are_the_papers_values_and_a_recipes_own_value_wins():
    x = _inputs(3)
    x["old_logp_BT"] = x["logp_BT"] - 0.3  # ratios e^0.3: SAPO's gate differs with tau
    for name, kwargs in [
        ("gspo", {"clip_low": 3e-4, "clip_high": 4e-4}),
        ("gmpo", {"clip_low": 0.4, "clip_high": 0.4}),
        ("sapo", {"tau_pos": 1.0, "tau_neg": 1.05}),
        ("cispo", {"clip_low": 1.0, "clip_high": 0.28}),
        ("kl_cov", {"cov_ratio": 2e-3, "kl_cov_coef": 1.0}),
    ]:
        got, _, _ = _call(policy_loss_of(AlgorithmConfig(policy_loss=name, loss_agg_mode=_agg(name))), x)
        fn = algos.get_policy_loss(name)
        want, _, _ = _call(fn, x, loss_agg_mode=_agg(name), **kwargs)
        assert torch.equal(got, want), name
    own = AlgorithmConfig(policy_loss="sapo", loss_params=PolicyLossParams(tau_pos=3.0))
    got, _, _ = _call(policy_loss_of(own), x)
    assert torch.equal(got, _call(algos.sapo_policy_loss, x, tau_pos=3.0)[0])
    assert not torch.equal(got, _call(algos.sapo_policy_loss, x)[0])
    defaults = algos.clip_cov_policy_loss.__kwdefaults__
    assert (defaults["cov_ratio"], defaults["cov_lb"], defaults["cov_ub"]) == (2e-4, 1.0, 5.0)


@pytest.mark.parametrize("name", NEW)
def test_padding_never_changes_loss_metrics_or_gradients(name):
    x = _inputs(4)
    ref, ent = x["logp_BT"] + 0.1, torch.rand(4, 6, dtype=torch.float64)
    kwargs = {"loss_agg_mode": _agg(name), "entropy_coef": 0.01, "kl_loss_coef": 0.1}

    def run(fill):
        pad = lambda t: torch.where(x["mask_BT"], t, torch.full_like(t, fill))  # noqa: E731
        dirty = {k: pad(v) if k != "mask_BT" else v for k, v in x.items()}
        return _call(algos.get_policy_loss(name), dirty, entropy_BT=pad(ent), ref_logp_BT=pad(ref), **kwargs)

    clean_loss, clean_metrics, clean_grad = run(0.0)
    for fill in (math.nan, 1e6, -1e6):
        loss, metrics, grad = run(fill)
        torch.testing.assert_close(loss, clean_loss)
        torch.testing.assert_close(grad, clean_grad)
        assert torch.all(grad[~x["mask_BT"]] == 0)
        for key, value in clean_metrics.items():
            torch.testing.assert_close(metrics[key], value, equal_nan=True)
