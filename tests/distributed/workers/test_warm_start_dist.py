"""The actor's SFT warm start (`actor.warm_start`, `rl3d.controller.warm_start`) on the real
megatron actor: it trains (the loss falls), the same way in every layout (the loss curve of
TP=2, PP=2 and DP=2 equals the single rank's from the same initial weights), leaves the RL
optimizer as a fresh one (learning rates and scheduler as before, Adam's state empty), and keeps
observation tokens out of the loss: changing an observation token's target changes neither the
loss nor any gradient, while changing a policy token's target does."""

import pytest
import torch

from rl3d.testing.spawn import run_distributed

pytestmark = pytest.mark.distributed

RECIPE = "recipes/quickstart_cpu_tool_grpo.yaml"
STEPS = 12


def overrides(hf_dir, layout_pdt=(1, 1, 1)):
    p, t, d = layout_pdt
    return [
        f"model.hf_path={hf_dir}",
        f"actor.parallel={{pp: {p}, tp: {t}, dp: {d}}}",
        f"launch.nproc_per_node={p * t * d}",
        "rollout.t_g=1",
        "actor.micro_batch_size=4",
        "actor.warm_start.num_examples=24",
        f"actor.warm_start.steps={STEPS}",
        "actor.warm_start.batch_size=8",
        "actor.warm_start.lr=3e-3",
    ]


def build_actor(hf_dir, layout_pdt):
    from rl3d.config import load_config
    from rl3d.data.tool_task import ToolTokenizer
    from rl3d.models.bootstrap import init_megatron
    from rl3d.models.spec import spec_of
    from rl3d.parallel.layout import ParallelLayout
    from rl3d.workers.context import RoleContext
    from rl3d.workers.roles import ActorRolloutWorker

    cfg = load_config(RECIPE, overrides(hf_dir, layout_pdt)).config
    groups = init_megatron(ParallelLayout(*layout_pdt), seed=cfg.trainer.seed)
    spec = spec_of(cfg.model)
    tok = ToolTokenizer(spec.vocab_size)
    return cfg, tok, ActorRolloutWorker(RoleContext(cfg, spec, groups, tok))


def sft_worker(rank, world, layout_pdt, hf_dir):
    from rl3d.controller.warm_start import warm_start
    from rl3d.models.bootstrap import destroy_megatron

    cfg, tok, actor = build_actor(hf_dir, layout_pdt)
    opt = actor.role.optimizer
    lrs = [g["lr"] for g in opt.param_groups]
    sched = actor.role.scheduler.num_steps
    history = warm_start(actor, cfg, tok)
    after = {
        "lrs_kept": [g["lr"] for g in opt.param_groups] == lrs,
        "scheduler_kept": actor.role.scheduler.num_steps == sched,
        "adam_state": len(opt.optimizer.state),
    }
    destroy_megatron()
    return history, after


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from rl3d.testing.tiny_hf import save_tiny_hf_model

    path = tmp_path_factory.mktemp("hf") / "tiny-llama-v32"
    save_tiny_hf_model("tiny-llama-v32", path, seed=5)
    return path


@pytest.fixture(scope="module")
def single_rank(hf_dir):
    """One process: the warm start's curve, then the masking check on a fresh actor."""
    run_dir = hf_dir.parent / "run"
    run_dir.mkdir()
    [out] = run_distributed(single_rank_worker, 1, str(hf_dir), str(run_dir), timeout_s=300)
    return out


def single_rank_worker(rank, world, hf_dir, run_dir):
    history, after = sft_worker(rank, world, (1, 1, 1), hf_dir)
    out = {"losses": [r["warm_start/loss"] for r in history], "after": after}
    return out | mask_worker(rank, world, hf_dir) | reference_worker(rank, world, hf_dir, run_dir)


def reference_worker(rank, world, hf_dir, run_dir):
    """The rank's roles as a run builds them (`build_rank_workers`): the reference is the warmed
    actor, not `model.hf_path`'s weights."""
    from pathlib import Path

    from rl3d.config import load_config
    from rl3d.config.pools import hosting, role_pools
    from rl3d.controller.rank import build_rank_workers
    from rl3d.data.tool_task import ToolTokenizer
    from rl3d.models.bootstrap import destroy_megatron, init_megatron
    from rl3d.models.spec import spec_of
    from rl3d.parallel.layout import ParallelLayout

    cfg = load_config(RECIPE, overrides(hf_dir)).config
    groups = init_megatron(ParallelLayout(1, 1, 1), seed=cfg.trainer.seed)
    spec = spec_of(cfg.model)
    pools = role_pools(cfg)
    tok = ToolTokenizer(spec.vocab_size)
    built = build_rank_workers(
        cfg, spec, groups, tok, pools=pools, pool=hosting(pools, "actor"), run_dir=Path(run_dir)
    )
    actor = built.workers["actor"].role.unwrapped().state_dict()
    ref = built.workers["reference"].role.unwrapped().state_dict()
    same = all(torch.equal(actor[k], v) for k, v in ref.items() if torch.is_tensor(v) and k in actor)
    destroy_megatron()
    rows = (Path(run_dir) / "warm_start.jsonl").read_text().splitlines()
    return {"reference_is_warmed_actor": same, "log_rows": len(rows)}


def test_sft_trains_and_leaves_a_fresh_optimizer(single_rank):
    losses, after = single_rank["losses"], single_rank["after"]
    assert len(losses) == STEPS
    assert losses[-1] < 0.7 * losses[0], losses  # from ~3.5 nats (uniform over 32 ids)
    assert after == {"lrs_kept": True, "scheduler_kept": True, "adam_state": 0}


def test_a_built_rank_warms_the_actor_first_and_the_reference_copies_it(single_rank):
    # with model.hf_path set, the reference would otherwise load the unwarmed weights
    assert single_rank["reference_is_warmed_actor"]
    assert single_rank["log_rows"] == STEPS  # run_dir/warm_start.jsonl, one row per step


@pytest.mark.slow
@pytest.mark.parametrize("layout_pdt", [(1, 2, 1), (2, 1, 1), (1, 1, 2)], ids=["tp2", "pp2", "dp2"])
def test_sft_loss_curve_is_the_same_in_every_layout(hf_dir, single_rank, layout_pdt):
    results = run_distributed(sft_worker, 2, layout_pdt, str(hf_dir), timeout_s=240)
    curves = [[r["warm_start/loss"] for r in history] for history, _ in results if history]
    assert len(curves) == 1  # the collector rank (last stage, TP rank 0, DP rank 0)
    assert curves[0] == pytest.approx(single_rank["losses"], abs=2e-4)
    assert all(after["adam_state"] == 0 and after["lrs_kept"] for _, after in results)


def mask_worker(rank, world, hf_dir):
    """Loss and gradients of one batch of demonstrations, as given and with one target changed
    at an observation position and at a policy position."""
    from rl3d.controller.warm_start import demonstration, demonstration_batch, load_rows, sft_loss
    from rl3d.models.bootstrap import destroy_megatron

    cfg, tok, actor = build_actor(hf_dir, (1, 1, 1))
    demos = [demonstration(r, tok) for r in load_rows(cfg.actor.warm_start)[:4]]
    width = (max(len(d.prompt_ids) for d in demos), max(len(d.response_ids) for d in demos))
    batch = demonstration_batch(demos, pad_token_id=0, width=width)
    mask = batch["response_mask"]
    observed = int((mask[0] == 0).nonzero()[0])  # the first observation token of row 0
    policy = int(mask[0].nonzero()[0])
    role = actor.role
    loss_of = sft_loss(role)

    def loss_and_grads(b):
        outs = role.run_forward(b, 4, loss_of)
        role.forward_backward(b, 4, loss_of)
        grads = [p.main_grad.clone() for p in role.unwrapped().parameters()]
        return float(outs[0]["warm_start/loss"]), grads

    def with_target(pos):
        b = demonstration_batch(demos, pad_token_id=0, width=width)
        b["responses"][0, pos] = (int(b["responses"][0, pos]) + 7) % tok.vocab_size  # the context stays
        return loss_and_grads(b)

    out = {"mask_row0": mask[0].tolist(), "base": loss_and_grads(batch)}
    out["observation"], out["policy"] = with_target(observed), with_target(policy)
    destroy_megatron()
    return out


def test_observation_tokens_are_outside_the_sft_loss(single_rank):
    out = single_rank
    assert 0 in out["mask_row0"] and out["mask_row0"][0] == 1  # the call trained, the result not
    (loss, grads), (obs_loss, obs_grads) = out["base"], out["observation"]
    assert obs_loss == loss
    assert all(torch.equal(a, b) for a, b in zip(grads, obs_grads))
    pol_loss, pol_grads = out["policy"]
    assert pol_loss != loss
    assert not all(torch.equal(a, b) for a, b in zip(grads, pol_grads))
