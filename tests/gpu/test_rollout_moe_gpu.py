"""The torch engine's q/k-norm and mixture-of-experts layers on a CUDA device (skipped without
CUDA): fp32 log-probs equal HF transformers' Qwen3-MoE / Qwen2-MoE on the same device within
1e-4, and the routing record equals HF's router top-k on every token."""

import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
GPU_LOGPROB_TOL = 1e-4
PROMPTS = [[5, 17, 3], [200, 9, 31, 44, 2, 7, 99], [1], [64, 65]]
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "rollout"))


@pytest.mark.parametrize("name", ["tiny-qwen3-moe", "tiny-qwen2-moe"])
def test_moe_engine_on_cuda_matches_hf(name):
    from hf_to_engine import tiny_hf_model

    from rl3d.rollout import SamplingParams, TorchRolloutEngine

    spec, model, tensors = tiny_hf_model(name)
    model = model.cuda()
    engine = TorchRolloutEngine(spec, {k: v.cuda() for k, v in tensors.items()}, record_routing=True)
    batch = engine.generate(PROMPTS, SamplingParams(max_new_tokens=12, n=2, seed=3))
    worst = 0.0
    for row, resp in enumerate(batch.responses()):
        ids = PROMPTS[int(batch.prompt_index[row])] + resp
        with torch.no_grad():
            out = model(torch.tensor([ids], device="cuda"), output_router_logits=True)
        plen = len(ids) - len(resp)
        logp = torch.log_softmax(out.logits[0, plen - 1 : -1].float(), dim=-1)
        ref = logp.gather(-1, torch.tensor(resp, device="cuda")[:, None]).squeeze(-1).cpu()
        worst = max(worst, (batch.logprobs[row, : len(resp)] - ref).abs().max().item())
        routes = torch.stack(
            [torch.topk(lg.view(len(ids), -1), spec.moe_top_k, dim=-1).indices for lg in out.router_logits], 1
        )
        assert torch.equal(batch.routing[row].long(), routes.cpu()), row
    assert worst <= GPU_LOGPROB_TOL, worst
