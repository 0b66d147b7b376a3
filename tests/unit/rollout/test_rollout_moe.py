"""The torch engine on Qwen3 (q/k norm, head width != hidden / heads), Qwen3-MoE, Qwen2-MoE
(shared expert) and GLM-4.5 (dense first layer, sigmoid router with its correction bias, partial
RoPE, QKV bias), against HF transformers' own models of the same random weights (fp32, eager).

Sampled log-probs (prefill: the first token; decode with the KV cache: the rest) equal HF's
log_softmax at the same tokens within 1e-5, and greedy tokens equal HF `generate`'s.
"""

import pytest
import torch
from hf_to_engine import tiny_hf_model
from test_rollout_hf_generate import PROMPTS as GREEDY_PROMPTS
from test_rollout_hf_generate import hf_greedy
from test_rollout_torch_engine import PROMPTS, reference_logprobs

from rl3d.rollout import SamplingParams, TorchRolloutEngine
from rl3d.rollout.model import ShardedWeights
from rl3d.rollout.moe import engine_param_names, topk_set_mismatch

LOGPROB_TOL = 1e-5  # fp32
MODELS = ["tiny-qwen3", "tiny-qwen3-moe", "tiny-qwen2-moe", "tiny-glm4-moe"]


@pytest.fixture(scope="module", params=MODELS)
def tiny(request):
    return tiny_hf_model(request.param)


def test_logprobs_match_hf(tiny):
    spec, model, tensors = tiny
    batch = TorchRolloutEngine(spec, tensors).generate(
        PROMPTS, SamplingParams(max_new_tokens=12, n=2, seed=3)
    )
    worst = 0.0
    for row, (resp, lps) in enumerate(zip(batch.responses(), batch.token_logprobs())):
        ref = reference_logprobs(model, PROMPTS[int(batch.prompt_index[row])], resp)
        worst = max(worst, (torch.tensor(lps) - ref).abs().max().item())
    assert worst <= LOGPROB_TOL, worst


def test_greedy_equals_hf_generate(tiny):
    spec, model, tensors = tiny
    new_tokens = 10
    batch = TorchRolloutEngine(spec, tensors).generate(
        GREEDY_PROMPTS, SamplingParams(max_new_tokens=new_tokens, temperature=0.0)
    )
    for prompt, ours in zip(GREEDY_PROMPTS, batch.responses()):
        assert ours == hf_greedy(model, prompt, new_tokens), prompt


def test_engine_needs_every_moe_parameter(tiny):
    spec, _, tensors = tiny
    names = engine_param_names(spec)
    assert sorted(names) == sorted(tensors)
    if spec.is_moe:
        dense = [n for n in names if n.endswith("mlp.linear_fc1.weight") and "experts" not in n]
        assert dense == [
            f"decoder.layers.{i}.mlp.linear_fc1.weight" for i in range(spec.moe_first_dense_layers)
        ]
    for missing in [n for n in names if "layers.1." in n]:
        with pytest.raises(ValueError, match="lack"):
            ShardedWeights.from_tensors(spec, {n: t for n, t in tensors.items() if n != missing})


def hf_routes(model, ids, k):
    """HF's chosen experts per token and layer, [tokens, layers, k], from its routers (a dense
    layer's: zeros). A sigmoid router chooses by sigmoid + its correction bias, unsorted: sorted
    by that score here."""
    with torch.no_grad():
        logits = model(torch.tensor([ids]), output_router_logits=True).router_logits
    layers, routers = model.model.layers, iter(logits)
    out = []
    for layer in layers:
        gate = getattr(layer.mlp, "gate", None)
        if not hasattr(gate, "top_k"):
            out.append(torch.zeros(len(ids), k, dtype=torch.long))
            continue
        score = next(routers).view(len(ids), -1)
        if hasattr(gate, "e_score_correction_bias"):
            score = score.sigmoid() + gate.e_score_correction_bias
        out.append(torch.topk(score, k, dim=-1).indices)
    return torch.stack(out, 1)


@pytest.mark.parametrize("name", ["tiny-qwen3-moe", "tiny-qwen2-moe", "tiny-glm4-moe"])
def test_routing_record_equals_hf_router(name):
    """Every token of prompt + response, including a stopped row's last token, is recorded as
    HF's router routes it; recording changes no sampled token."""
    spec, model, tensors = tiny_hf_model(name)
    params = SamplingParams(max_new_tokens=10, n=2, seed=5, stop_token_ids=tuple(range(0, 256, 9)))
    plain = TorchRolloutEngine(spec, tensors).generate(PROMPTS, params)
    batch = TorchRolloutEngine(spec, tensors, record_routing=True).generate(PROMPTS, params)
    assert plain.routing is None
    assert torch.equal(batch.response_ids, plain.response_ids)
    assert (batch.logprobs - plain.logprobs).abs().max().item() <= LOGPROB_TOL
    assert "stop" in batch.finish_reasons and "length" in batch.finish_reasons
    for row, resp in enumerate(batch.responses()):
        ids = PROMPTS[int(batch.prompt_index[row])] + resp
        record = batch.routing[row]
        assert record.dtype == torch.int16
        assert record.shape == (len(ids), spec.num_layers, spec.moe_top_k)
        assert torch.equal(record.long(), hf_routes(model, ids, spec.moe_top_k)), row


def test_routing_record_needs_experts():
    spec, _, tensors = tiny_hf_model("tiny-qwen3")
    with pytest.raises(ValueError, match="record_routing"):
        TorchRolloutEngine(spec, tensors, record_routing=True)


def test_bf16_engine_routes_in_fp32():
    """A bf16 engine keeps the fp32 router it was given (no rounded copy); its log-probs stay
    within bf16 accuracy of HF's fp32 model at the tokens it sampled (measured 0.036)."""
    spec, model, tensors = tiny_hf_model("tiny-qwen3-moe")
    engine = TorchRolloutEngine(spec, tensors, dtype=torch.bfloat16)
    assert engine.weights.layers[0].moe.router_fp32 is tensors["decoder.layers.0.mlp.router.weight"]
    assert engine.weights.layers[0].moe.fc1[0][0].dtype == torch.bfloat16
    batch = engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, seed=3))
    for row, resp in enumerate(batch.responses()):
        ref = reference_logprobs(model, PROMPTS[row], resp)
        assert (batch.logprobs[row, : len(resp)] - ref).abs().max().item() < 0.15


def test_topk_set_mismatch_counts_decisions():
    a = torch.tensor([[[0, 1], [2, 3]], [[4, 5], [6, 7]]])  # 2 tokens, 2 layers, k = 2
    b = torch.tensor([[[1, 0], [2, 3]], [[4, 6], [6, 7]]])  # same set reordered; one set differs
    assert topk_set_mismatch(a, a) == 0.0 and topk_set_mismatch(a, b) == 0.25
    with pytest.raises(ValueError, match="shapes"):
        topk_set_mismatch(a, b[:1])


@pytest.mark.parametrize("name", ["tiny-qwen3-moe", "tiny-qwen2-moe", "tiny-glm4-moe"])
def test_training_tp_pieces_equal_whole_tensors(name):
    """Generation weights made of t=2 training shards (t_g=1: two pieces per parameter, each
    expert's SwiGLU included) give the whole tensors' tokens and routing, and are used in place."""
    from hf_to_engine import tp_shard

    from rl3d.hybrid_engine.weights import GenerationWeights

    spec, _, tensors = tiny_hf_model(name)
    shards = [tp_shard(spec, tensors, 2, r) for r in range(2)]
    pieces = {n: [shards[0][n], shards[1][n]] for n in tensors}
    weights = GenerationWeights(spec=spec, params={}, train_tp=2, gen_tp=1, gen_tp_rank=0, pieces=pieces)
    params = SamplingParams(max_new_tokens=8, n=2, seed=5)
    a = TorchRolloutEngine(spec, weights, record_routing=True).generate(PROMPTS, params)
    b = TorchRolloutEngine(spec, tensors, record_routing=True).generate(PROMPTS, params)
    assert torch.equal(a.response_ids, b.response_ids)
    assert all(torch.equal(x, y) for x, y in zip(a.routing, b.routing, strict=True))
    assert (a.logprobs - b.logprobs).abs().max().item() <= LOGPROB_TOL
    expert = "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"
    engine = TorchRolloutEngine(spec, weights)
    assert all(x is y for x, y in zip(engine.weights.layers[1].moe.fc1[3], pieces[expert], strict=True))
