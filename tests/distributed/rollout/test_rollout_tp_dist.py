"""The torch rollout engine on the 3D-HybridEngine's generation weights, over gloo.

Two ranks hold the training shards of a t=2 model. The HybridFlow transition gives them
generation weights for t_g=1 (each rank: both pieces of the whole model, one its own training
tensor) and for t_g=2 (each rank: its own shard, a 2-rank generation-TP group). Generation at
t_g=2 must give exactly the tokens of t_g=1 and the same log-probs within 1e-5, on both ranks,
and both must equal the one-process engine on the unsharded model. The SGLang adapter's
Megatron -> HF tensors, gathered over the generation-TP group into the planned buckets (the bytes
gathered are the plan's), equal the full model's bit for bit.
"""

import pytest
import torch

LOGPROB_TOL = 1e-5
PROMPTS = [[5, 17, 3], [200, 9, 31, 44, 2, 7, 99], [1], [64, 65], [8, 8, 8, 8, 8]]


def _settings():
    from rl3d.rollout import SamplingParams

    return {
        "t1": SamplingParams(max_new_tokens=10, n=2, seed=3),
        "filtered": SamplingParams(max_new_tokens=10, temperature=0.8, top_k=30, top_p=0.9, seed=4),
        "greedy_stop": SamplingParams(max_new_tokens=10, temperature=0.0, stop_token_ids=(1, 2, 3, 4, 5)),
    }


def tp_worker(rank, world, models):
    from rl3d.hybrid_engine.engine_push import plan_engine_push, push_mismatch
    from rl3d.hybrid_engine.executor import Resharder
    from rl3d.hybrid_engine.params import model_params
    from rl3d.hybrid_engine.weights import full_model, training_shards
    from rl3d.models.spec import get_model_spec
    from rl3d.parallel import GenerationLayout, ParallelLayout
    from rl3d.parallel.groups import build_hybrid_groups
    from rl3d.rollout import SamplingParams, TorchRolloutEngine
    from rl3d.rollout.model import TPComm
    from rl3d.rollout.sglang_weights import Pushed, megatron_to_hf, planned_buckets

    train = ParallelLayout(1, 2, 1)
    groups = {
        t_g: build_hybrid_groups(GenerationLayout.from_training(train, t_g), timeout_s=60) for t_g in (1, 2)
    }
    out = {}
    for model in models:
        spec = get_model_spec(model)
        params = model_params(spec, train_tp=2)
        full = full_model(params, seed=1, dtype=torch.float32)
        full = {k: (1 + 0.1 * v) if k.endswith("norm.weight") else 0.15 * v for k, v in full.items()}
        shards = training_shards(
            full, params, pp_rank=0, pp=1, tp_rank=rank, tp=2, num_layers=spec.num_layers
        )
        if spec.tied_embeddings:
            full.pop("output_layer.weight")
        engines = {}
        for t_g, g in groups.items():
            weights = Resharder(spec, g, dtype=torch.float32).to_generation(shards)
            engines[t_g] = TorchRolloutEngine(spec, weights, group=g.gen_tp)
            # no extra copy: the rank's own training tensors are pieces the engine computes from
            own = [n for n, ps in engines[t_g].weights.pieces.items() if any(p is shards[n] for p in ps)]
            assert len(own) == len(shards), (t_g, len(own), len(shards))
            # the SGLang adapter's whole HF tensors in the planned buckets (all-gathered over the
            # group at t_g=2: the gathered bytes are the plan's)
            push = plan_engine_push(spec, params, t_g, dtype="float32", bucket_bytes=2**16)
            pushed, hf = Pushed(), {}
            for bucket in planned_buckets(spec, weights, push.buckets, TPComm(g.gen_tp), pushed):
                pushed.add(bucket)
                hf.update(bucket)
            assert push_mismatch(push, pushed) is None and (push.gather_bytes > 0) == (t_g > 1), t_g
            ref = {k: v for name, t in full.items() for k, v in megatron_to_hf(spec, name, [t])}
            assert hf.keys() == ref.keys() and all(torch.equal(hf[k], ref[k]) for k in ref), t_g
        engines[0] = TorchRolloutEngine(spec, full)  # one process, unsharded
        for key, sp in _settings().items():
            for t_g, engine in engines.items():
                b = engine.generate(PROMPTS, sp)
                out[(model, key, t_g)] = (b.response_ids, b.logprobs, b.raw_logprobs, b.finish_reasons)
        b = engines[2].generate(PROMPTS, SamplingParams(max_new_tokens=6))  # seed drawn, then shared
        out[(model, "noseed", 2)] = (b.response_ids, b.logprobs, b.raw_logprobs, b.finish_reasons)
        try:  # ranks disagreeing on the prompts: a clear error on every rank, not a hang
            engines[2].generate(PROMPTS if rank == 0 else PROMPTS[:2], SamplingParams(max_new_tokens=2))
            out[(model, "mismatch")] = "no error"
        except ValueError as err:
            out[(model, "mismatch")] = str(err)
    return out


@pytest.mark.distributed
def test_tg2_equals_tg1_and_unsharded():
    from rl3d.testing.spawn import run_distributed

    models = ["tiny-llama", "tiny-qwen2"]
    results = run_distributed(tp_worker, 2, models, timeout_s=240)
    worst = 0.0
    for model in models:
        for key in _settings():
            ref_ids, ref_lp, ref_raw, ref_fin = results[0][(model, key, 0)]
            for rank in range(2):
                for t_g in (1, 2):
                    ids, lp, raw, fin = results[rank][(model, key, t_g)]
                    assert torch.equal(ids, ref_ids), (model, key, rank, t_g)
                    assert fin == ref_fin
                    worst = max(worst, (lp - ref_lp).abs().max().item(), (raw - ref_raw).abs().max().item())
        a, b = results[0][(model, "noseed", 2)], results[1][(model, "noseed", 2)]
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        assert all("different prompts" in results[r][(model, "mismatch")] for r in range(2))
    assert worst <= LOGPROB_TOL, worst
