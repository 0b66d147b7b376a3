"""The actor's forward runs megatron's output layer only on the positions that predict response
tokens (`engine.batches.response_outputs`): the output layer then sees R positions, not T,
and the log-probs and the gradients equal those of the whole-sequence output layer within
fp32 rounding (1e-6), at tp 1 and (slow) tp 2."""

import pytest
import torch

from rl3d.testing.spawn import run_distributed

pytestmark = pytest.mark.distributed

RECIPE = "recipes/quickstart_cpu_grpo.yaml"
B, P, R = 6, 7, 5
TOL = 1e-6


def worker(rank, world, hf_dir):
    from rl3d.config import load_config
    from rl3d.models.bootstrap import destroy_megatron, init_megatron
    from rl3d.models.spec import spec_of
    from rl3d.parallel.layout import ParallelLayout
    from rl3d.single_controller.batch import DataBatch
    from rl3d.workers.context import RoleContext
    from rl3d.workers.roles import ActorRolloutWorker

    overrides = [f"model.hf_path={hf_dir}", f"actor.parallel={{pp: 1, tp: {world}, dp: 1}}"]
    overrides += [f"launch.nproc_per_node={world}", f"rollout.t_g={world}"]
    cfg = load_config(RECIPE, overrides).config
    groups = init_megatron(ParallelLayout(1, world, 1), seed=cfg.trainer.seed)
    spec = spec_of(cfg.model)
    actor = ActorRolloutWorker(RoleContext(cfg, spec, groups, tokenizer=None))
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(3, spec.vocab_size, (B, P + R), generator=gen)
    mask = torch.ones(B, P + R, dtype=torch.long)
    mask[:3, :2] = 0  # left-padded prompts
    batch = DataBatch({"input_ids": ids, "attention_mask": mask, "responses": ids[:, P:]})
    batch = batch.set("response_mask", torch.ones(B, R, dtype=torch.long))
    default = actor.role.batches.response_outputs  # the actor's, as a training run builds it
    seen = []
    layer = actor.role.unwrapped().output_layer
    # what the output layer computed: its output's sequence length ([S, B, V/tp], bias)
    handle = layer.register_forward_hook(lambda _m, _args, out: seen.append(out[0].shape[0]))
    out, grads = {}, {}
    for flag in (False, True):
        actor.role.batches.response_outputs = flag
        out[flag] = actor.compute_log_prob(batch)["old_logp"]
        actor.role.forward_backward(
            batch, B, lambda o, m: (actor._logp_entropy(o, m, actor.role)[0].sum(), {})
        )
        grads[flag] = {n: p.main_grad.clone() for n, p in actor.role.unwrapped().named_parameters()}
    handle.remove()
    destroy_megatron()
    logp_diff = (out[True] - out[False]).abs().max().item()
    grad_diff = max((grads[True][n] - grads[False][n]).abs().max().item() for n in grads[True])
    return {"seen": seen, "logp_diff": logp_diff, "grad_diff": grad_diff, "default": default}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from rl3d.testing.tiny_hf import save_tiny_hf_model

    path = tmp_path_factory.mktemp("hf") / "tiny-llama"
    save_tiny_hf_model("tiny-llama", path, seed=3)
    return path


def check(results):
    for got in results:
        assert got["default"] is True, got  # on for the actor unless a test turns it off
        assert got["seen"] == [P + R, P + R, R, R], got  # whole sequence, then response positions
        assert got["logp_diff"] <= TOL and got["grad_diff"] <= TOL, got


def test_output_layer_on_response_positions_only(hf_dir):  # the actor's and reference's default
    check(run_distributed(worker, 1, str(hf_dir), timeout_s=240))


@pytest.mark.slow
def test_output_layer_on_response_positions_only_tp2(hf_dir):
    check(run_distributed(worker, 2, str(hf_dir), timeout_s=240))
