"""The torch engine with LoRA adapters on the 3D-HybridEngine's generation weights, over gloo.

Two ranks hold the training shards of a t=2 model; the HybridFlow transition gives them
generation weights for t_g=1 (two pieces each) and t_g=2 (a 2-rank generation-TP group). Both
receive the same whole PEFT adapter tensors and keep their own slices. In the apply and the merge
mode, the log-probs must equal HF transformers + peft within 1e-5 on both ranks, and the
rank's own training tensors (which the engine computes from) stay bit for bit unchanged.
"""

import pytest
import torch

from rl3d.models.spec import get_model_spec

LOGPROB_TOL = 1e-5
PROMPTS = [[5, 17, 3], [200, 9, 31, 44, 2, 7, 99], [64]]


def lora_worker(rank, world, name, full, tensors, config):
    from rl3d.hybrid_engine.executor import Resharder
    from rl3d.hybrid_engine.params import model_params
    from rl3d.hybrid_engine.weights import training_shards
    from rl3d.models.spec import get_model_spec
    from rl3d.parallel import GenerationLayout, ParallelLayout
    from rl3d.parallel.groups import build_hybrid_groups
    from rl3d.rollout import SamplingParams, TorchRolloutEngine

    spec = get_model_spec(name)
    params = model_params(spec, train_tp=2)
    shards = training_shards(full, params, pp_rank=0, pp=1, tp_rank=rank, tp=2, num_layers=spec.num_layers)
    before = {k: v.clone() for k, v in shards.items()}
    out = {}
    for t_g in (1, 2):
        g = build_hybrid_groups(GenerationLayout.from_training(ParallelLayout(1, 2, 1), t_g), timeout_s=60)
        weights = Resharder(spec, g, dtype=torch.float32).to_generation(shards)
        for mode in ("apply", "merge"):
            engine = TorchRolloutEngine(spec, weights, group=g.gen_tp, lora_mode=mode)
            engine.load_lora(tensors, config)
            b = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, n=2, seed=5))
            out[(t_g, mode)] = (b.response_ids, b.lengths, b.logprobs, b.prompt_index)
    out["base_unchanged"] = all(torch.equal(shards[k], before[k]) for k in shards)
    return out


@pytest.mark.distributed
def test_lora_tg1_tg2_equal_hf_peft(tmp_path):
    from rl3d.hybrid_engine.params import model_params
    from rl3d.testing.lora import hf_logprobs, megatron_from_hf, peft_adapter
    from rl3d.testing.spawn import run_distributed
    from rl3d.testing.tiny_hf import make_tiny_hf_model

    name = "tiny-llama"  # untied output layer: vocab-parallel output pieces too
    spec = get_model_spec(name)
    model = make_tiny_hf_model(spec, seed=1)
    padded = model_params(spec, train_tp=2)[0].shape[0]
    full = megatron_from_hf(spec, model, padded)
    peft_model, tensors, config = peft_adapter(model, tmp_path)
    results = run_distributed(lora_worker, 2, name, full, tensors, config, timeout_s=240)
    worst, first = 0.0, results[0][(1, "apply")][0]
    for rank in range(2):
        assert results[rank].pop("base_unchanged")
        for key, (ids, lengths, logprobs, prompt_index) in results[rank].items():
            assert torch.equal(ids, first), (rank, key)  # same tokens at every t_g, in both modes
            for row in range(len(ids)):
                n = int(lengths[row])
                ref = hf_logprobs(peft_model, PROMPTS[int(prompt_index[row])], ids[row, :n].tolist())
                worst = max(worst, (logprobs[row, :n] - ref).abs().max().item())
    assert worst <= LOGPROB_TOL, worst
