"""A LoRA run end to end (GRPO at tp=2 on an HF Qwen2 directory, adapters on every linear, and on
lm_head too: its vocabulary of 200 is padded to 256 in megatron; the reference KL on: the
reference is the actor's base): it trains, checkpoints, and comes back out as a PEFT adapter
directory that real `peft` loads onto the HF base with the actor's logits, and as merged HF
weights with the same logits."""

import subprocess
import sys

import pytest
import torch
from test_hf_export import own_qwen2  # noqa: F401  (the fixture)
from train_helpers import GRPO, metrics_by_step, run_train, train_env

pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # 36 s at load 3; both targets 250 s at load 18
peft = pytest.importorskip("peft")

LORA = ["actor.lora.rank=4", "actor.lora.alpha=8"]
TOL = 1e-5  # fp32 logits, megatron vs HF kernels


def export(run_dir, *args):
    return subprocess.run(
        [sys.executable, "-m", "rl3d.cli", "export", str(run_dir), *args],
        capture_output=True, text=True, timeout=300, env=train_env(),
    )  # fmt: skip


def lora_logits(rank, world_size, hf_dir, checkpoint, ids, targets):
    """rl3d's LoRA actor from the training checkpoint (megatron's loader, adapters included)."""
    from types import SimpleNamespace

    from rl3d.config.lora import LoraConfig
    from rl3d.engine import Features, MegatronEngine
    from rl3d.engine.techniques import Lora
    from rl3d.models.bootstrap import destroy_megatron, init_megatron
    from rl3d.models.dist_checkpoint import load_checkpoint
    from rl3d.models.spec import spec_of
    from rl3d.parallel.layout import ParallelLayout

    spec = spec_of(SimpleNamespace(name=None, hf_path=hf_dir))
    groups = init_megatron(ParallelLayout(1, 1, 1), seed=1)
    lora = LoraConfig(rank=4, alpha=8.0, target_modules=targets)
    features = Features([Lora(lora)])
    role = MegatronEngine(spec, groups, role="actor", params_dtype=torch.float32, seed=1, features=features)
    load_checkpoint(checkpoint, ddp=role.model, optimizer=None, scheduler=None, groups=groups)
    moved = max(t.abs().max() for k, t in role.lora_state_dict().items() if "lora_B" in k)
    with torch.no_grad():
        logits = role.model(ids, torch.arange(ids.shape[1]).expand_as(ids), None)[..., : spec.vocab_size]
    destroy_megatron()
    return logits, float(moved)


@pytest.mark.parametrize(
    "targets", [["all-linear"], ["all-linear", "lm_head"]], ids=["all-linear", "lm_head"]
)
def test_a_lora_run_exports_a_peft_adapter_and_merged_weights_with_the_actor_s_logits(
    own_qwen2,  # noqa: F811
    tmp_path,
    targets,
):
    from transformers import AutoModelForCausalLM

    from rl3d.testing.spawn import run_distributed

    run_dir = tmp_path / "run"
    lora = [*LORA, f"actor.lora.target_modules=[{','.join(targets)}]"]
    proc = run_train(GRPO, run_dir, "model.name=null", f"model.hf_path={own_qwen2}", "trainer.total_steps=2",
                     "checkpoint.save_every=2", *lora)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = metrics_by_step(run_dir)
    assert sorted(metrics) == [1, 2] and "time/ref_logp" in metrics[2]  # the reference ran

    refused = export(run_dir, "--dst", str(tmp_path / "plain"))
    assert refused.returncode != 0 and "--lora DIR" in refused.stderr
    adapter, merged = tmp_path / "adapter", tmp_path / "merged"
    for args in (["--lora", str(adapter)], ["--dst", str(merged), "--merge"]):
        proc = export(run_dir, *args)
        assert proc.returncode == 0, proc.stderr[-3000:]

    ids = torch.randint(0, 200, (2, 13), generator=torch.Generator().manual_seed(0))
    step_dir = run_dir / "checkpoints" / "step_00000002"
    ((ours, moved),) = run_distributed(
        lora_logits, 1, str(own_qwen2), str(step_dir / "actor"), ids, targets, timeout_s=300
    )
    assert moved > 0  # B starts at zero: the adapters trained
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(str(own_qwen2)).eval()
        with_peft = peft.PeftModel.from_pretrained(base, str(adapter)).eval()(ids).logits
        from_merged = AutoModelForCausalLM.from_pretrained(str(merged)).eval()(ids).logits
    assert (ours - with_peft).abs().max() < TOL
    assert (ours - from_merged).abs().max() < TOL
