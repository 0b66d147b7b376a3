"""Megatron distributed checkpoint of model + optimizer + scheduler + RNG on gloo: a run that
saves, then continues in freshly built objects loaded from the checkpoint, takes the same steps
bit for bit as the run that never stopped."""

import json

import pytest
import torch

from rl3d.testing.spawn import run_distributed

pytestmark = pytest.mark.distributed
# megatron's torch_dist checkpoint writer needs psutil (not a declared megatron-core dependency).
pytest.importorskip("psutil", reason="megatron-core's checkpoint writer needs psutil")

SEQ = 8


def _setup(layout_pdt, hf_dir, dist_opt, load_hf):
    from rl3d.config import OptimConfig
    from rl3d.models.bootstrap import init_megatron
    from rl3d.models.builder import build_gpt
    from rl3d.models.hf_mapping import spec_from_hf_config
    from rl3d.models.training import build_optimizer, build_scheduler, wrap_ddp
    from rl3d.models.weights import load_weights
    from rl3d.parallel.layout import ParallelLayout

    groups = init_megatron(ParallelLayout(*layout_pdt), seed=99 if not load_hf else 1234)
    spec = spec_from_hf_config(json.loads(open(f"{hf_dir}/config.json").read()))
    model = build_gpt(spec, groups)
    if load_hf:
        load_weights(model, spec, groups, hf_dir)
    ddp = wrap_ddp(model, groups, use_distributed_optimizer=dist_opt)
    cfg = OptimConfig(
        lr=1e-2, weight_decay=0.01, lr_warmup_steps=2, lr_schedule="cosine", distributed_optimizer=dist_opt
    )
    optimizer = build_optimizer(ddp, groups, cfg)
    return spec, groups, ddp, optimizer, build_scheduler(optimizer, cfg, total_steps=10)


def _step(spec, groups, ddp, optimizer, scheduler, step):
    from rl3d.models.logprobs import vocab_parallel_logprobs_entropy
    from rl3d.models.training import train_step

    gen = torch.Generator().manual_seed(step)
    data = torch.randint(0, spec.vocab_size, (2 * groups.layout.d, SEQ + 1), generator=gen)
    mine = data[2 * groups.dp_rank : 2 * groups.dp_rank + 2]

    def forward_step(seq, chunk):
        out = chunk(seq[None, :-1], torch.arange(SEQ)[None], None)
        # Draw from the CPU generator, so a restored RNG state matters to the loss.
        noise = 1e-3 * torch.rand(())

        def loss_func(logits):
            logp, _ = vocab_parallel_logprobs_entropy(
                logits, seq[None, 1:], groups.tp_group, vocab_size=spec.vocab_size
            )
            loss = -logp.mean() + noise
            return loss, {"loss": loss.detach().clone()}

        return out, loss_func

    outs, _ = train_step(
        ddp,
        optimizer,
        groups,
        forward_step,
        list(mine),
        num_microbatches=2,
        seq_length=SEQ,
        micro_batch_size=1,
        scheduler=scheduler,
    )
    return [o["loss"] for o in outs]


def worker(rank, world, layout_pdt, hf_dir, ckpt, dist_opt):
    from rl3d.models.bootstrap import destroy_megatron
    from rl3d.models.dist_checkpoint import load_checkpoint, save_checkpoint

    spec, groups, ddp, optimizer, scheduler = _setup(layout_pdt, hf_dir, dist_opt, load_hf=True)
    for step in range(2):
        _step(spec, groups, ddp, optimizer, scheduler, step)
    save_checkpoint(ckpt, ddp=ddp, optimizer=optimizer, scheduler=scheduler, groups=groups, iteration=2)
    straight = [_step(spec, groups, ddp, optimizer, scheduler, step) for step in (2, 3)]
    lr = optimizer.param_groups[0]["lr"]
    destroy_megatron()

    # A fresh model (other random init), optimizer and scheduler, restored from the checkpoint.
    spec, groups, ddp, optimizer, scheduler = _setup(layout_pdt, hf_dir, dist_opt, load_hf=False)
    iteration = load_checkpoint(ckpt, ddp=ddp, optimizer=optimizer, scheduler=scheduler, groups=groups)
    resumed = [_step(spec, groups, ddp, optimizer, scheduler, step) for step in (2, 3)]
    resumed_lr = optimizer.param_groups[0]["lr"]
    destroy_megatron()
    return groups.coords, iteration, straight, resumed, lr, resumed_lr


@pytest.mark.parametrize(
    ("layout_pdt", "dist_opt"),
    [
        pytest.param((1, 2, 1), False, marks=pytest.mark.slow),
        ((1, 1, 2), True),
        pytest.param((2, 1, 2), True, marks=pytest.mark.slow),
    ],
    ids=["tp2", "dp2-distopt", "pp2xdp2-distopt"],
)
def test_resume_from_checkpoint_is_bit_exact(tmp_path, layout_pdt, dist_opt):
    from rl3d.testing.tiny_hf import save_tiny_hf_model

    save_tiny_hf_model("tiny-qwen2", tmp_path / "hf", seed=4)
    p, t, d = layout_pdt
    results = run_distributed(
        worker, p * t * d, layout_pdt, str(tmp_path / "hf"), str(tmp_path / "ckpt"), dist_opt
    )
    for coords, iteration, straight, resumed, lr, resumed_lr in results:
        assert iteration == 2
        assert lr == resumed_lr and lr > 0
        if coords.pp == p - 1:
            assert len(straight[0]) == 2
            for a, b in zip(straight, resumed):
                assert torch.equal(torch.stack(a), torch.stack(b)), (coords, a, b)
