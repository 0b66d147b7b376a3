"""A mixture-of-experts critic at TP 2 (sequence parallelism on by `auto`: its value head gathers
the sequence the decoder split over the TP ranks) against TP 1: the same tiny Qwen3-MoE (and
Qwen2-MoE: a shared expert with its gate) weights,
the values of a batch (its 11 columns padded to 12) and, after one PPO value update (2 Adam
steps), the values again, fp32. Both within 1e-5 (the log-prob tests' bound for a TP split)."""

from pathlib import Path

import pytest
import torch

from rl3d.testing.spawn import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[3]
RECIPE = ROOT / "recipes/quickstart_cpu_ppo.yaml"
B, P, R = 8, 6, 5
TOL = 1e-5


def _batch(vocab):
    gen = torch.Generator().manual_seed(7)
    prompt_len = torch.randint(2, P + 1, (B,), generator=gen)
    resp_len = torch.randint(1, R + 1, (B,), generator=gen)
    cols = torch.arange(P + R)
    mask = ((cols >= P - prompt_len[:, None]) & (cols < P + resp_len[:, None])).long()
    ids = torch.randint(3, vocab, (B, P + R), generator=gen) * mask
    resp_mask = mask[:, P:]
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "responses": ids[:, P:],
        "response_mask": resp_mask,
        "returns": torch.randn(B, R, generator=gen) * resp_mask,
    }


def worker(rank, world, hf_dir, batch):
    from rl3d.config import load_config
    from rl3d.engine.techniques import SequenceParallel
    from rl3d.models.bootstrap import destroy_megatron, init_megatron
    from rl3d.models.spec import spec_of
    from rl3d.parallel.layout import ParallelLayout
    from rl3d.single_controller.batch import DataBatch
    from rl3d.workers.context import RoleContext
    from rl3d.workers.roles import CriticWorker

    overrides = [
        "model.name=null",
        f"model.hf_path={hf_dir}",
        "model.dtype=float32",
        f"actor.parallel={{pp: 1, tp: {world}, dp: 1}}",
        f"critic.parallel={{pp: 1, tp: {world}, dp: 1}}",
        f"launch.nproc_per_node={world}",
        f"critic.mini_batch_size={B // 2}",
        f"critic.micro_batch_size={B // 4}",
        f"actor.mini_batch_size={B // 2}",
        f"actor.micro_batch_size={B // 4}",
        f"data.prompts_per_step={B // 2}",
    ]
    cfg = load_config(RECIPE, overrides).config
    groups = init_megatron(ParallelLayout(1, world, 1), seed=cfg.trainer.seed)
    critic = CriticWorker(RoleContext(cfg, spec_of(cfg.model), groups, tokenizer=None, init_path=str(hf_dir)))
    data = DataBatch(dict(batch))
    before = critic.compute_values(data)["values"]
    critic.update_critic(data.set("values", before))
    after = critic.compute_values(data)["values"]
    split = critic.role.features.get(SequenceParallel) is not None
    destroy_megatron()
    return split, before, after


@pytest.mark.parametrize("model", ["tiny-qwen3-moe", "tiny-qwen2-moe"])
def test_moe_critic_at_tp2_equals_tp1(tmp_path, model):
    from rl3d.models.spec import get_model_spec
    from rl3d.testing.tiny_hf import save_tiny_hf_model

    hf_dir = tmp_path / model
    save_tiny_hf_model(model, hf_dir, seed=5)
    batch = _batch(get_model_spec(model).vocab_size)
    (one,) = run_distributed(worker, 1, str(hf_dir), batch, timeout_s=300)
    two = run_distributed(worker, 2, str(hf_dir), batch, timeout_s=300)
    assert one[0] is False and [r[0] for r in two] == [True, True]
    moved = (one[2] - one[1]).abs().max().item()
    assert moved > 100 * TOL  # the update changed the values
    for _, before, after in two:  # both TP ranks hold every position's value
        diffs = (before - one[1]).abs().max().item(), (after - one[2]).abs().max().item()
        assert max(diffs) <= TOL, diffs
    print(f"{model}: max |values TP2 - TP1| before, after the update: {diffs[0]:.2e}, {diffs[1]:.2e}")
