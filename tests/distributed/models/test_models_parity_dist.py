"""HF vs rl3d's Megatron model on gloo: logits within 1e-5 (fp32) at TP=2, PP=2 and TP=2 x PP=2;
vocab-parallel log-probs equal log_softmax of the full logits; the weight loaders and savers
reshard exactly."""

import json

import pytest
import torch

from rl3d.testing.spawn import run_distributed

pytestmark = pytest.mark.distributed

BATCH, SEQ = 2, 12


def _batch(vocab):
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(0, vocab, (BATCH, SEQ + 1), generator=gen)
    return ids[:, :-1], ids[:, 1:]


def _forward(model, groups, spec, ids):
    """Logits (this rank's vocab slice) through megatron's schedule; None off the last stage."""
    from rl3d.models.training import forward_backward

    def step(batch, chunk):
        out = chunk(batch, torch.arange(SEQ).expand(BATCH, SEQ), None)
        return out, lambda output: (output.sum() * 0, {"out": output.detach().clone()})

    outs = forward_backward(
        model,
        groups,
        step,
        [ids],
        num_microbatches=1,
        seq_length=SEQ,
        micro_batch_size=BATCH,
        forward_only=True,
    )
    return outs[0]["out"] if groups.is_last_stage else None


def worker(rank, world, layout_pdt, hf_dirs, tmp):
    from rl3d.models.bootstrap import destroy_megatron, init_megatron
    from rl3d.models.builder import build_gpt
    from rl3d.models.convert import hf_to_mcore, mcore_to_hf
    from rl3d.models.hf_mapping import spec_from_hf_config
    from rl3d.models.logprobs import vocab_parallel_logprobs_entropy
    from rl3d.models.weights import load_weights, save_weights
    from rl3d.parallel.layout import ParallelLayout

    layout = ParallelLayout(*layout_pdt)
    groups = init_megatron(layout)
    result = {"coords": groups.coords}
    for name, hf_dir in hf_dirs.items():
        hf_config = json.loads(open(f"{hf_dir}/config.json").read())
        spec = spec_from_hf_config(hf_config)
        ids, target = _batch(spec.vocab_size)
        actor = build_gpt(spec, groups)
        load_weights(actor, spec, groups, hf_dir)
        logits = _forward(actor, groups, spec, ids)
        critic = build_gpt(spec, groups, role="critic", seed=3)
        load_weights(critic, spec, groups, hf_dir, role="critic")
        values = _forward(critic, groups, spec, ids)
        out = {"logits": logits, "values": values}
        if logits is not None:
            leaf = logits.clone().requires_grad_(True)
            logp, entropy = vocab_parallel_logprobs_entropy(
                leaf, target, groups.tp_group, vocab_size=spec.vocab_size
            )
            (logp.sum() + 0.5 * entropy.sum()).backward()
            out.update(logp=logp.detach(), entropy=entropy.detach(), grad=leaf.grad)
        if layout.t * layout.p == 4:
            # Load the same weights from a Megatron directory of another layout (resharded).
            if rank == 0:
                hf_to_mcore(hf_dir, f"{tmp}/{name}-t1p2", tp=1, pp=2)
            torch.distributed.barrier()
            again = build_gpt(spec, groups)
            load_weights(again, spec, groups, f"{tmp}/{name}-t1p2")
            other = _forward(again, groups, spec, ids)
            out["resharded_equal"] = other is None or torch.equal(other, logits)
            # A live model's weights -> Megatron directory -> HF directory.
            save_weights(actor, spec, groups, f"{tmp}/{name}-saved", hf_config=hf_config)
            if rank == 0:
                mcore_to_hf(f"{tmp}/{name}-saved", f"{tmp}/{name}-hf")
        result[name] = out
    destroy_megatron()
    return result


def _reference(hf_dir):
    from transformers import AutoModelForCausalLM

    from rl3d.models.logprobs import logprobs_entropy_reference

    cfg = json.loads((hf_dir / "config.json").read_text())
    ids, target = _batch(cfg["vocab_size"])
    hf = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    with torch.no_grad():
        logits = hf(ids).logits
    leaf = logits.clone().requires_grad_(True)
    logp, entropy = logprobs_entropy_reference(leaf, target)
    (logp.sum() + 0.5 * entropy.sum()).backward()
    return logits, logp.detach(), entropy.detach(), leaf.grad


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    from rl3d.testing.tiny_hf import save_tiny_hf_model

    root = tmp_path_factory.mktemp("hf")
    for name in ("tiny-llama", "tiny-qwen2"):
        save_tiny_hf_model(name, root / name, seed=5)
    return {name: root / name for name in ("tiny-llama", "tiny-qwen2")}


@pytest.fixture(scope="module")
def critic_values_1x1(hf_dirs, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("one")
    results = run_distributed(worker, 1, (1, 1, 1), {k: str(v) for k, v in hf_dirs.items()}, str(tmp))
    return {name: results[0][name]["values"] for name in hf_dirs}


@pytest.mark.parametrize(
    "layout_pdt",
    [(1, 2, 1), (2, 1, 1), pytest.param((2, 2, 1), marks=pytest.mark.slow)],
    ids=["tp2", "pp2", "tp2xpp2"],
)
def test_logits_match_hf(hf_dirs, critic_values_1x1, tmp_path, layout_pdt):
    p, t, _ = layout_pdt
    results = run_distributed(
        worker, p * t, layout_pdt, {k: str(v) for k, v in hf_dirs.items()}, str(tmp_path)
    )
    last = sorted((r for r in results if r["coords"].pp == p - 1), key=lambda r: r["coords"].tp)
    for name, hf_dir in hf_dirs.items():
        ref_logits, ref_logp, ref_entropy, ref_grad = _reference(hf_dir)
        vocab = ref_logits.shape[-1]
        logits = torch.cat([r[name]["logits"] for r in last], dim=-1)[..., :vocab]
        diff = (logits - ref_logits).abs().max().item()
        assert diff < 1e-5, (name, diff)
        for r in last:  # every TP rank gets the full-vocabulary log-probs and entropy
            torch.testing.assert_close(r[name]["logp"], ref_logp, rtol=1e-6, atol=1e-5)
            torch.testing.assert_close(r[name]["entropy"], ref_entropy, rtol=1e-6, atol=1e-5)
        grad = torch.cat([r[name]["grad"] for r in last], dim=-1)
        torch.testing.assert_close(grad[..., :vocab], ref_grad, rtol=0, atol=1e-6)
        assert torch.all(grad[..., vocab:] == 0)
        for r in last:  # the critic's value head is replicated over TP, same values as 1-1-1
            torch.testing.assert_close(r[name]["values"], critic_values_1x1[name], rtol=0, atol=1e-5)
        if p * t == 4:
            assert all(r[name]["resharded_equal"] for r in results)
            from rl3d.models.safetensors_io import ShardedReader

            with ShardedReader(hf_dir) as a, ShardedReader(tmp_path / f"{name}-hf") as b:
                assert sorted(a.weight_map) == sorted(b.weight_map)
                for key in a.weight_map:
                    assert torch.equal(a.get(key), b.get(key)), key
