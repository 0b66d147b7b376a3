"""Packed micro-batches against padded ones, fp32, from the same HF weights.

The actor's response log-probs and the critic's values, and the actor's parameters after one
optimizer step (Adam, clipping on), packed vs padded in the same layout: within 1e-6. Packed
runs once with `micro_batch_size` sequences per row and once under a token budget, which
regroups the samples (longest first) into a different number of micro-batches, so the
token-mean loss's rescaling and the output reordering are both exercised.

Not bit for bit: a packed row computes attention over N keys where the padded row has T (other
reduction lengths in softmax and the score matmuls), and RoPE rotates by the per-sequence
position where the padded row rotates by the column (relative angles equal, absolute ones differ).
"""

import json

import pytest
import torch

from rl3d.testing.spawn import run_distributed

pytestmark = pytest.mark.distributed

B, P, R, MICRO, BUDGET = 8, 6, 10, 2, 20
TOL = 1e-6


def make_batch(vocab, *, resp_len=(10, 1, 2, 7, 1, 3, 9, 2), seed=21):
    """Left-padded prompts, right-padded responses of skewed lengths, advantages."""
    gen = torch.Generator().manual_seed(seed)
    prompt_len = torch.randint(2, P + 1, (B,), generator=gen)
    resp_len = torch.tensor(resp_len)
    prompt_mask = torch.arange(P) >= P - prompt_len[:, None]
    resp_mask = torch.arange(R) < resp_len[:, None]
    prompt = torch.randint(16, vocab, (B, P), generator=gen).masked_fill(~prompt_mask, 0)
    resp = torch.randint(16, vocab, (B, R), generator=gen).masked_fill(~resp_mask, 0)
    return {
        "input_ids": torch.cat([prompt, resp], 1),
        "attention_mask": torch.cat([prompt_mask, resp_mask], 1).long(),
        "responses": resp,
        "response_mask": resp_mask.long(),
        "advantages": torch.randn(B, R, generator=gen) * resp_mask,
    }


def worker(rank, world, layout_pdt, hf_dir):
    from rl3d.config import OptimConfig
    from rl3d.engine import Features, InitialWeights, MegatronEngine, Training
    from rl3d.engine.techniques import Packing
    from rl3d.models.bootstrap import destroy_megatron, init_megatron
    from rl3d.models.hf_mapping import spec_from_hf_config
    from rl3d.models.logprobs import vocab_parallel_logprobs_entropy
    from rl3d.parallel.layout import ParallelLayout
    from rl3d.single_controller.batch import DataBatch

    groups = init_megatron(ParallelLayout(*layout_pdt))
    spec = spec_from_hf_config(json.loads(open(f"{hf_dir}/config.json").read()))
    d = groups.layout.d
    full = DataBatch(make_batch(spec.vocab_size))
    share = B // d
    batch = full.slice(groups.dp_rank * share, (groups.dp_rank + 1) * share)  # MEGATRON_COMPUTE split
    optim = OptimConfig(lr=1e-3, adam_eps=1e-5, clip_grad=1.0, weight_decay=0.01)
    modes = {  # each role its own features
        "padded": lambda: Features(),
        "packed": lambda: Features([Packing()]),
        "budget": lambda: Features([Packing(max_tokens=BUDGET)]),
    }

    def logp_of(role):
        def extract(output, micro):
            logits = role.response_slice(output, micro)
            logp, _ = vocab_parallel_logprobs_entropy(
                logits, micro["responses"], groups.tp_group, vocab_size=spec.vocab_size
            )
            return torch.zeros(()), {"logp": logp * micro["response_mask"]}

        return extract

    def loss_of(role):
        def loss(output, micro):
            logp = logp_of(role)(output, micro)[1]["logp"]
            mask = micro["response_mask"]
            value = -(logp * micro["advantages"]).sum() / mask.sum().clamp(min=1)
            return value, {"loss": value.detach()}

        return loss

    out = {}
    for name, features in modes.items():
        common = dict(params_dtype=torch.float32, seed=5, weights=InitialWeights(hf_path=hf_dir))
        training = Training(optim, total_steps=10)
        actor = MegatronEngine(spec, groups, role="actor", training=training, features=features(), **common)
        critic = MegatronEngine(spec, groups, role="critic", features=features(), **common)
        before = {k: v.detach().clone() for k, v in actor.unwrapped().named_parameters()}
        logp = actor.run_forward(batch, MICRO, logp_of(actor))
        values = critic.run_forward(
            batch,
            MICRO,
            lambda o, m, c=critic: (
                torch.zeros(()),
                {"v": c.response_slice(o, m)[..., 0] * m["response_mask"]},
            ),
        )
        actor.train_minibatches(
            batch,
            mini_batch_size=B,
            micro_batch_size=MICRO,
            epochs=1,
            loss_of=loss_of(actor),
            count_unit=lambda m: float(m["response_mask"].sum()),
        )
        params = {k: v.detach().clone() for k, v in actor.unwrapped().named_parameters()}
        out[name] = {
            "logp": None if logp is None else torch.cat([o["logp"] for o in logp]),
            "values": None if values is None else torch.cat([o["v"] for o in values]),
            "params": params,
            "moved": max((params[k] - v).abs().max().item() for k, v in before.items()),
        }
    destroy_megatron()
    return out


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from rl3d.testing.tiny_hf import save_tiny_hf_model

    root = tmp_path_factory.mktemp("hf") / "tiny-qwen2"  # tied embeddings: the embedding group too
    save_tiny_hf_model("tiny-qwen2", root, seed=3)
    return str(root)


def _max_diffs(results):
    diffs = {}
    for res in results:
        for mode in ("packed", "budget"):
            for key in ("logp", "values"):
                if res["padded"][key] is not None:
                    d = (res[mode][key] - res["padded"][key]).abs().max().item()
                    diffs[f"{mode}/{key}"] = max(diffs.get(f"{mode}/{key}", 0.0), d)
            d = max(
                (res[mode]["params"][k] - v).abs().max().item() for k, v in res["padded"]["params"].items()
            )
            diffs[f"{mode}/params"] = max(diffs.get(f"{mode}/params", 0.0), d)
    assert min(res["padded"]["moved"] for res in results) > 1e-4  # the step really updates
    return diffs


@pytest.mark.parametrize(
    "layout_pdt",
    [(1, 2, 1), (2, 1, 1), (1, 1, 2), pytest.param((2, 2, 1), marks=pytest.mark.slow)],
    ids=["tp2", "pp2", "dp2", "tp2xpp2"],
)
def test_packed_equals_padded(hf_dir, layout_pdt):
    p, t, d = layout_pdt
    results = run_distributed(worker, p * t * d, layout_pdt, hf_dir, timeout_s=240)
    diffs = _max_diffs(results)
    print(layout_pdt, {k: f"{v:.1e}" for k, v in diffs.items()})
    assert len(diffs) == 6, diffs
    assert max(diffs.values()) <= TOL, diffs
