"""A few optimizer steps at TP=2, PP=2, DP=2 (with and without the distributed optimizer) against
a one-process run: fp32, Adam, weight decay, gradient clipping on.

Exact (torch.equal) where the arithmetic is the same: PP=2 of an untied model (every gradient
is summed over the same microbatches in the same order) and DP=2 with one microbatch per rank
(the DP all-reduce adds the same two halves the one-process run adds), with and without the
distributed optimizer, with clipping on: on CPU the grad norm is summed in fp64 (the CPU
shim's `multi_tensor_l2norm`), so how the layout splits the norm's sum of squares does not
reach the fp32 clip coefficient.
Close, not exact, where a layout reorders a floating-point sum of the model itself:
- TP=2 splits the sums inside matmuls: the row-parallel projections (attention output, fc2) add
  two half-K partial sums in the all-reduce, and fc1's input gradient sums [gate_i; up_i] rows
  per rank. The first differing value is layer 0's attention output projection (1 ulp, 1e-7);
  embedding, QKV, attention and norms before it are bit-equal. No legitimate setting of
  threads, MKL (CBWR), oneDNN or determinism flags removes it; only a reference that imitated
  TP's split sums would. Measured over the 3 steps: max |loss diff| 4.8e-7 (1.3e-7 relative)
  at TP=2 and 2-2-2 with the distributed optimizer; 1.2e-6 (1.7e-6 relative) over 10 steps.
- PP=2 with tied embeddings adds the two stages' embedding gradients after summing over
  microbatches, where one process adds them per microbatch; likewise DP with several
  microbatches per rank.
"""

import json

import pytest
import torch

from rl3d.testing.spawn import run_distributed

pytestmark = pytest.mark.distributed

SEQ, STEPS = 8, 3


def worker(rank, world, layout_pdt, hf_dir, num_seq, use_distributed_optimizer, clip_grad=1.0, overlap=False):
    from rl3d.config import OptimConfig
    from rl3d.models.bootstrap import destroy_megatron, init_megatron
    from rl3d.models.builder import build_gpt
    from rl3d.models.hf_mapping import spec_from_hf_config
    from rl3d.models.logprobs import vocab_parallel_logprobs_entropy
    from rl3d.models.training import build_optimizer, build_scheduler, train_step, wrap_ddp
    from rl3d.models.weights import load_weights
    from rl3d.parallel.layout import ParallelLayout

    layout = ParallelLayout(*layout_pdt)
    groups = init_megatron(layout)
    spec = spec_from_hf_config(json.loads(open(f"{hf_dir}/config.json").read()))
    model = build_gpt(spec, groups)
    load_weights(model, spec, groups, hf_dir)
    ddp = wrap_ddp(
        model, groups, use_distributed_optimizer=use_distributed_optimizer, overlap_grad_reduce=overlap
    )
    cfg = OptimConfig(
        lr=1e-2, clip_grad=clip_grad, weight_decay=0.01, distributed_optimizer=use_distributed_optimizer
    )
    optimizer = build_optimizer(ddp, groups, cfg)
    scheduler = build_scheduler(optimizer, cfg, total_steps=1_000_000)

    data = torch.randint(0, spec.vocab_size, (num_seq, SEQ + 1), generator=torch.Generator().manual_seed(0))
    per_rank = num_seq // layout.d
    mine = data[groups.dp_rank * per_rank : (groups.dp_rank + 1) * per_rank]

    def forward_step(seq, chunk):
        ids, target = seq[None, :-1], seq[None, 1:]
        out = chunk(ids, torch.arange(SEQ)[None], None)

        def loss_func(logits):
            logp, _ = vocab_parallel_logprobs_entropy(
                logits, target, groups.tp_group, vocab_size=spec.vocab_size
            )
            loss = -logp.mean()
            return loss, {"loss": loss.detach().clone()}

        return out, loss_func

    losses = []
    for _ in range(STEPS):
        outs, _ = train_step(
            ddp,
            optimizer,
            groups,
            forward_step,
            list(mine),
            num_microbatches=per_rank,
            seq_length=SEQ,
            micro_batch_size=1,
            scheduler=scheduler,
        )
        losses.append([o["loss"] for o in outs])
    destroy_megatron()
    return groups.coords, losses


def _global_losses(results, layout_pdt):
    """Per-step losses of all sequences in order, from the last stage's TP rank 0."""
    p, _, d = layout_pdt
    by_dp = {c.dp: losses for c, losses in results if c.pp == p - 1 and c.tp == 0}
    return torch.stack(
        [torch.stack([x for dp in range(d) for x in by_dp[dp][step]]) for step in range(STEPS)]
    )


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    from rl3d.testing.tiny_hf import save_tiny_hf_model

    root = tmp_path_factory.mktemp("hf")
    for name in ("tiny-llama", "tiny-qwen2"):  # untied; tied (exercises the embedding group)
        save_tiny_hf_model(name, root / name, seed=2)
    return {name: str(root / name) for name in ("tiny-llama", "tiny-qwen2")}


_references = {}


def _run(hf_dirs, name, num_seq, layout_pdt, dist_opt, clip_grad, overlap=False):
    p, t, d = layout_pdt
    results = run_distributed(
        worker, p * t * d, layout_pdt, hf_dirs[name], num_seq, dist_opt, clip_grad, overlap
    )
    return _global_losses(results, layout_pdt)


def _reference(hf_dirs, name, num_seq, clip_grad):
    key = (name, num_seq, clip_grad)
    if key not in _references:
        _references[key] = _run(hf_dirs, name, num_seq, (1, 1, 1), False, clip_grad)
    return _references[key]


@pytest.mark.parametrize(
    ("layout_pdt", "dist_opt"),
    [
        ((2, 1, 1), False),
        ((1, 1, 2), False),
        ((1, 1, 2), True),
        pytest.param((2, 1, 2), True, marks=pytest.mark.slow),
    ],
    ids=["pp2", "dp2", "dp2-distopt", "pp2xdp2-distopt"],
)
def test_loss_equals_one_process_exactly(hf_dirs, layout_pdt, dist_opt):
    reference = _reference(hf_dirs, "tiny-llama", 2, 1.0)
    losses = _run(hf_dirs, "tiny-llama", 2, layout_pdt, dist_opt, 1.0)
    assert reference[-1].mean() < reference[0].mean() - 0.5  # the steps really train
    assert torch.equal(losses, reference), (losses - reference).abs().max()


@pytest.mark.parametrize(
    ("layout_pdt", "dist_opt"),
    [
        ((1, 2, 1), False),
        ((2, 1, 1), False),
        pytest.param((2, 2, 2), True, marks=pytest.mark.slow),
    ],
    ids=["tp2", "pp2-tied", "tp2xpp2xdp2-distopt"],
)
def test_loss_close_to_one_process(hf_dirs, layout_pdt, dist_opt):
    reference = _reference(hf_dirs, "tiny-qwen2", 4, 1.0)
    losses = _run(hf_dirs, "tiny-qwen2", 4, layout_pdt, dist_opt, 1.0)
    assert reference[-1].mean() < reference[0].mean() - 0.5
    assert (losses[0] - reference[0]).abs().max() < 2e-6  # before any update: forward only
    torch.testing.assert_close(losses, reference, rtol=1e-5, atol=0)


@pytest.mark.parametrize("dist_opt", [False, True], ids=["ddp", "distopt"])
def test_overlapped_gradient_reduction_trains_the_same(hf_dirs, dist_opt):
    """`overlap_grad_reduce` (`<role>.megatron`, on by default on CUDA): megatron's DDP reduces
    the gradient buckets asynchronously from the backward's hooks, the schedules' no_sync_func
    holding the reduction back to the last micro-batch. Exercised here on gloo (one optimizer
    instance: no CUDA stream involved): DP=2 with one and with two micro-batches per rank gives
    the losses of the same layout without it, bit for bit (one micro-batch: the one-process run's)."""
    reference = _reference(hf_dirs, "tiny-llama", 2, 1.0)
    assert torch.equal(_run(hf_dirs, "tiny-llama", 2, (1, 1, 2), dist_opt, 1.0, overlap=True), reference)
    plain = _run(hf_dirs, "tiny-llama", 4, (1, 1, 2), dist_opt, 1.0)
    assert torch.equal(_run(hf_dirs, "tiny-llama", 4, (1, 1, 2), dist_opt, 1.0, overlap=True), plain)
