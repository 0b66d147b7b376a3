"""LoRA under TP=2, PP=2, DP=2 against one process (fp32, tiny-qwen2: tied embeddings, QKV bias,
adapters on every linear): the gathered adapter gradients of two steps, and the adapters after
them, equal the one-process run's; the base stays bit for bit what it was loaded as; the DDP
buffers and the optimizer hold the adapters and nothing else.

Tolerances as the full-parameter layouts' (test_models_training_dist.py): PP=2 and DP=2 with one
micro-batch per rank add the same numbers in the same order; TP=2 splits the sums inside the
row-parallel matmuls and the rank-r partial sums of A (1e-7 scale differences).
"""

import json

import pytest
import torch

from rl3d.testing.spawn import run_distributed

pytestmark = pytest.mark.distributed

SEQ, NUM_SEQ, STEPS = 8, 2, 2


def worker(rank, world, layout_pdt, hf_dir, adapters, dist_opt, targets=("all-linear",)):
    from rl3d.config import OptimConfig
    from rl3d.config.lora import LoraConfig
    from rl3d.engine import Features, InitialWeights, MegatronEngine, Training
    from rl3d.engine.techniques import Lora
    from rl3d.models.bootstrap import destroy_megatron, init_megatron
    from rl3d.models.hf_mapping import spec_from_hf_config
    from rl3d.models.logprobs import vocab_parallel_logprobs_entropy
    from rl3d.models.training import forward_backward
    from rl3d.parallel.layout import ParallelLayout

    layout = ParallelLayout(*layout_pdt)
    groups = init_megatron(layout)
    spec = spec_from_hf_config(json.loads(open(f"{hf_dir}/config.json").read()))
    lora = LoraConfig(rank=4, alpha=8.0, target_modules=list(targets))
    optim = OptimConfig(lr=1e-2, clip_grad=1.0, weight_decay=0.01, distributed_optimizer=dist_opt)
    role = MegatronEngine(
        spec,
        groups,
        role="actor",
        params_dtype=torch.float32,
        seed=3,
        training=Training(optim, total_steps=100),
        weights=InitialWeights(hf_path=hf_dir),
        features=Features([Lora(lora)]),
    )
    role.lora.load_state_dict(adapters)
    model = role.unwrapped()
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    trained = set(role.lora.parameters())
    assert base and {p for p in model.parameters() if p.requires_grad} == trained
    assert set(role.ddp.param_to_bucket_group) == trained  # no gradient buffer for the base

    data = torch.randint(0, spec.vocab_size, (NUM_SEQ, SEQ + 1), generator=torch.Generator().manual_seed(0))
    per_rank = NUM_SEQ // layout.d
    mine = list(data[groups.dp_rank * per_rank : (groups.dp_rank + 1) * per_rank])

    def forward_step(seq, chunk):
        out = chunk(seq[None, :-1], torch.arange(SEQ)[None], None)

        def loss_func(logits):
            logp, _ = vocab_parallel_logprobs_entropy(
                logits, seq[None, 1:], groups.tp_group, vocab_size=spec.vocab_size
            )
            return -logp.mean(), {}

        return out, loss_func

    grads = []
    model.train()
    for _ in range(STEPS):
        role.ddp.zero_grad_buffer()
        role.optimizer.zero_grad()
        forward_backward(role.ddp, groups, forward_step, mine, num_microbatches=per_rank,
                         seq_length=SEQ, micro_batch_size=1)  # fmt: skip
        if not dist_opt:  # the distributed optimizer keeps only its shard of a reduced gradient
            grads.append(role.lora.state_dict(of=lambda p: p.main_grad.detach()))
        ok, _, _ = role.optimizer.step()
        assert ok
    if dist_opt:
        held = sum(p.numel() for g in role.optimizer.param_groups for p in g["params"])
    else:
        held = {id(p) for g in role.optimizer.param_groups for p in g["params"]} == {id(p) for p in trained}
    unchanged = all(torch.equal(p, base[n]) for n, p in model.named_parameters() if n in base)
    after = role.lora_state_dict()
    destroy_megatron()
    return {"grads": grads, "after": after, "unchanged": unchanged, "held": held}


def _adapters(hf_dir, lm_head=False):
    """Random full adapters (B non-zero, so both factors get gradients), under PEFT's keys."""
    from rl3d.models.hf_mapping import spec_from_hf_config
    from rl3d.models.lora_names import LM_HEAD, LORA_TARGETS, peft_key

    spec = spec_from_hf_config(json.loads(open(f"{hf_dir}/config.json").read()))
    nh, ng, hd, h, f = (spec.num_attention_heads, spec.num_query_groups, spec.head_dim,
                        spec.hidden_size, spec.ffn_hidden_size)  # fmt: skip
    shapes = {"q_proj": (nh * hd, h), "k_proj": (ng * hd, h), "v_proj": (ng * hd, h), "o_proj": (h, nh * hd),
              "gate_proj": (f, h), "up_proj": (f, h), "down_proj": (h, f)}  # fmt: skip
    gen = torch.Generator().manual_seed(5)
    out = {}
    for layer in range(spec.num_layers):
        for t in LORA_TARGETS:
            o, i = shapes[t]
            out[peft_key(layer, t, "A")] = torch.randn(4, i, generator=gen) * i**-0.5
            out[peft_key(layer, t, "B")] = torch.randn(o, 4, generator=gen) * 0.1
    if lm_head:
        out[peft_key(None, LM_HEAD, "A")] = torch.randn(4, h, generator=gen) * h**-0.5
        out[peft_key(None, LM_HEAD, "B")] = torch.randn(spec.vocab_size, 4, generator=gen) * 0.1
    return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from rl3d.testing.tiny_hf import save_tiny_hf_model

    hf_dir = tmp_path_factory.mktemp("hf") / "tiny-qwen2"
    save_tiny_hf_model("tiny-qwen2", hf_dir, seed=2)
    adapters = _adapters(str(hf_dir))
    (reference,) = run_distributed(worker, 1, (1, 1, 1), str(hf_dir), adapters, False, timeout_s=300)
    return str(hf_dir), adapters, reference


def _close(ours, ref, tol, what):
    """Exact with tol 0; else max |diff| within tol of the tensor's largest value."""
    assert ours.keys() == ref.keys()
    for k in ref:
        if tol == 0:
            assert torch.equal(ours[k], ref[k]), f"{what} {k}: {(ours[k] - ref[k]).abs().max():.2e}"
        else:
            diff, scale = (ours[k] - ref[k]).abs().max(), ref[k].abs().max()
            assert diff <= tol * scale, f"{what} {k}: {diff:.2e} against {scale:.2e}"


def _check(results, reference, *, tol, after_tol=None):
    for r in results:
        assert r["unchanged"] and r["held"] is True
        assert len(r["grads"]) == STEPS
        for step, (ours, ref) in enumerate(zip(r["grads"], reference["grads"])):
            _close(ours, ref, tol, f"step {step} gradient")
        _close(r["after"], reference["after"], tol if after_tol is None else after_tol, "after the steps")


@pytest.mark.parametrize(
    ("layout_pdt", "tol"),
    [((1, 2, 1), 1e-5), ((2, 1, 1), 0), ((1, 1, 2), 0)],  # 7-12 s each at load 3-5
    ids=["tp2", "pp2", "dp2"],
)
def test_adapter_gradients_and_steps_equal_one_process(setup, layout_pdt, tol):
    hf_dir, adapters, reference = setup
    assert reference["unchanged"] and reference["held"] is True
    assert any(g.abs().max() > 0 for g in reference["grads"][0].values())
    p, t, d = layout_pdt
    results = run_distributed(worker, p * t * d, layout_pdt, hf_dir, adapters, False, timeout_s=300)
    _check(results, reference, tol=tol)


@pytest.mark.slow
def test_three_dimensions_with_the_distributed_optimizer(setup):
    hf_dir, adapters, reference = setup
    results = run_distributed(worker, 8, (2, 2, 2), hf_dir, adapters, True, timeout_s=300)
    for r in results:
        assert r["unchanged"] and 0 < r["held"] < sum(v.numel() for v in adapters.values())
        _close(r["after"], reference["after"], 1e-5, "after the steps")


@pytest.fixture(scope="module")
def setup_lm_head(tmp_path_factory):
    """tiny-llama (untied output layer) with adapters on every linear and on lm_head."""
    from rl3d.testing.tiny_hf import save_tiny_hf_model

    hf_dir = tmp_path_factory.mktemp("hf") / "tiny-llama"
    save_tiny_hf_model("tiny-llama", hf_dir, seed=2)
    adapters = _adapters(str(hf_dir), lm_head=True)
    targets = ("all-linear", "lm_head")
    (reference,) = run_distributed(worker, 1, (1, 1, 1), str(hf_dir), adapters, False, targets, timeout_s=300)
    return str(hf_dir), adapters, targets, reference


@pytest.mark.slow
@pytest.mark.parametrize(
    ("layout_pdt", "tol", "after_tol"), [((1, 2, 1), 1e-5, 1e-4), ((2, 1, 1), 0, 0)], ids=["tp2", "pp2"]
)
def test_lm_head_adapter_gradients_and_steps_equal_one_process(setup_lm_head, layout_pdt, tol, after_tol):
    """The vocab-parallel output layer's adapter: B's rows split over TP, A's gradient summed.
    At TP=2 the gradients agree within 1e-5, the adapters after two Adam steps within 1e-4 (Adam
    normalises each element's step, so a near-zero gradient's rounding moves it by a different
    fraction of the lr: measured 5.4e-6 on a tensor of largest value 0.31)."""
    from rl3d.models.lora_names import LM_HEAD, peft_key

    hf_dir, adapters, targets, reference = setup_lm_head
    assert reference["grads"][0][peft_key(None, LM_HEAD, "A")].abs().max() > 0
    p, t, d = layout_pdt
    results = run_distributed(worker, p * t * d, layout_pdt, hf_dir, adapters, False, targets, timeout_s=300)
    _check(results, reference, tol=tol, after_tol=after_tol)
