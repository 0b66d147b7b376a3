"""A LoRA checkpoint saved at one layout and resumed at another (gloo, fp32, tiny-llama with
adapters on every linear and on lm_head): the adapters come back bit for bit, and training goes
on as the run that never stopped.

The run saves at TP=2 after two steps and takes two more; the resumed runs (TP=1 in one process,
PP=2 in two) load the checkpoint into freshly built roles whose adapters start elsewhere (another
seed), and take the same two steps. After them each adapter tensor is within 1e-3 of how far
those two steps moved it in the run that never stopped: TP splits the matmuls' sums (1e-7 scale
differences in the gradients) and Adam normalises each element's step, so an element whose
gradient is near zero moves by a different fraction of the lr (measured: at most 1.1e-5, against
moves of the order of the lr, 1e-2).
"""

import json

import pytest
import torch

from rl3d.testing.spawn import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # 236 s for both at load 20
pytest.importorskip("psutil", reason="megatron-core's checkpoint writer needs psutil")

SEQ, NUM_SEQ = 8, 2
TARGETS = ["all-linear", "lm_head"]


def _role(layout_pdt, hf_dir, seed):
    from rl3d.config import OptimConfig
    from rl3d.config.lora import LoraConfig
    from rl3d.engine import Features, InitialWeights, MegatronEngine, Training
    from rl3d.engine.techniques import Lora
    from rl3d.models.bootstrap import init_megatron
    from rl3d.models.hf_mapping import spec_from_hf_config
    from rl3d.parallel.layout import ParallelLayout

    groups = init_megatron(ParallelLayout(*layout_pdt))
    spec = spec_from_hf_config(json.loads(open(f"{hf_dir}/config.json").read()))
    lora = LoraConfig(rank=4, alpha=8.0, target_modules=TARGETS)
    optim = OptimConfig(lr=1e-2, clip_grad=1.0, weight_decay=0.01, lr_warmup_steps=2, lr_schedule="cosine")
    role = MegatronEngine(
        spec,
        groups,
        role="actor",
        params_dtype=torch.float32,
        seed=seed,
        training=Training(optim, total_steps=10),
        weights=InitialWeights(hf_path=hf_dir),
        features=Features([Lora(lora)]),
    )
    return spec, groups, role


def _step(spec, groups, role, step):
    from rl3d.models.logprobs import vocab_parallel_logprobs_entropy
    from rl3d.models.training import train_step

    gen = torch.Generator().manual_seed(step)
    data = torch.randint(0, spec.vocab_size, (NUM_SEQ, SEQ + 1), generator=gen)

    def forward_step(seq, chunk):
        out = chunk(seq[None, :-1], torch.arange(SEQ)[None], None)

        def loss_func(logits):
            logp, _ = vocab_parallel_logprobs_entropy(
                logits, seq[None, 1:], groups.tp_group, vocab_size=spec.vocab_size
            )
            return -logp.mean(), {}

        return out, loss_func

    role.unwrapped().train()
    train_step(role.ddp, role.optimizer, groups, forward_step, list(data), num_microbatches=NUM_SEQ,
               seq_length=SEQ, micro_batch_size=1, scheduler=role.scheduler)  # fmt: skip


def save_worker(rank, world, hf_dir, ckpt):
    from rl3d.models.bootstrap import destroy_megatron
    from rl3d.models.dist_checkpoint import save_checkpoint

    spec, groups, role = _role((1, 2, 1), hf_dir, seed=3)
    for step in range(2):
        _step(spec, groups, role, step)
    saved = role.lora_state_dict()
    save_checkpoint(ckpt, ddp=role.ddp, optimizer=role.optimizer, scheduler=role.scheduler, groups=groups,
                    iteration=2)  # fmt: skip
    for step in (2, 3):
        _step(spec, groups, role, step)
    straight = role.lora_state_dict()
    destroy_megatron()
    return saved, straight


def resume_worker(rank, world, layout_pdt, hf_dir, ckpt):
    from rl3d.models.bootstrap import destroy_megatron
    from rl3d.models.dist_checkpoint import load_checkpoint

    spec, groups, role = _role(layout_pdt, hf_dir, seed=11)
    fresh = role.lora_state_dict()
    iteration = load_checkpoint(ckpt, ddp=role.ddp, optimizer=role.optimizer, scheduler=role.scheduler,
                                groups=groups)  # fmt: skip
    loaded = role.lora_state_dict()
    for step in (2, 3):
        _step(spec, groups, role, step)
    resumed = role.lora_state_dict()
    destroy_megatron()
    return iteration, fresh, loaded, resumed


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    from rl3d.testing.tiny_hf import save_tiny_hf_model

    root = tmp_path_factory.mktemp("lora_resume")
    save_tiny_hf_model("tiny-llama", root / "hf", seed=2)
    hf_dir, ckpt = str(root / "hf"), str(root / "ckpt")
    ((at_save, straight), _) = run_distributed(save_worker, 2, hf_dir, ckpt, timeout_s=300)
    return hf_dir, ckpt, at_save, straight


@pytest.mark.parametrize(("layout_pdt", "world"), [((1, 1, 1), 1), ((2, 1, 1), 2)], ids=["tp1", "pp2"])
def test_a_lora_checkpoint_resumes_in_another_layout(saved, layout_pdt, world):
    from rl3d.models.lora_names import LM_HEAD, peft_key

    hf_dir, ckpt, at_save, straight = saved
    assert peft_key(None, LM_HEAD, "B") in at_save
    for iteration, fresh, loaded, resumed in run_distributed(
        resume_worker, world, layout_pdt, hf_dir, ckpt, timeout_s=300
    ):
        assert iteration == 2
        assert loaded.keys() == at_save.keys() == resumed.keys()
        assert any(not torch.equal(fresh[k], at_save[k]) for k in at_save)  # it did start elsewhere
        for k in at_save:
            assert torch.equal(loaded[k], at_save[k]), k
            diff, moved = (resumed[k] - straight[k]).abs().max(), (straight[k] - at_save[k]).abs().max()
            assert diff <= 1e-3 * moved, f"{k}: {diff:.2e} against a move of {moved:.2e}"
        assert any(not torch.equal(resumed[k], loaded[k]) for k in loaded)  # it trained on
