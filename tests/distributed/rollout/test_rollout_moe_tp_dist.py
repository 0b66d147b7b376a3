"""The torch engine's mixture-of-experts and q/k-norm layers under generation TP, over gloo.

Two ranks each hold one generation-TP shard (t_g = 2) of tiny Qwen3-MoE and Qwen2-MoE models
(tests/unit/rollout/hf_to_engine.py): every expert's SwiGLU is split like the dense MLP, the
router, the shared expert's gate and the q/k norms are replicated. Both ranks must give exactly
the tokens and routing records of the one-process engine on the whole model (t_g = 1), and
log-probs within 1e-5, sampling and greedy with stop tokens.
"""

import sys
from pathlib import Path

import pytest
import torch

from rl3d.testing.spawn import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # 2 ranks x 2 HF models: 160 s at load 17
ROLLOUT_TESTS = Path(__file__).resolve().parents[2] / "unit" / "rollout"
LOGPROB_TOL = 1e-5
PROMPTS = [[5, 17, 3], [200, 9, 31, 44, 2, 7, 99], [1], [64, 65], [8, 8, 8, 8, 8]]
MODELS = ["tiny-qwen3-moe", "tiny-qwen2-moe"]


def worker(rank, world, models):
    import torch.distributed as dist

    sys.path.insert(0, str(ROLLOUT_TESTS))
    from hf_to_engine import tiny_hf_model, tp_shard

    from rl3d.rollout import SamplingParams, TorchRolloutEngine

    settings = {
        "sample": SamplingParams(max_new_tokens=10, n=2, seed=3),
        "greedy_stop": SamplingParams(max_new_tokens=10, temperature=0.0, stop_token_ids=(1, 2, 3, 4, 5)),
    }
    out = {}
    for name in models:
        spec, _, full = tiny_hf_model(name)
        engines = {
            1: TorchRolloutEngine(spec, full, record_routing=True),
            2: TorchRolloutEngine(
                spec, tp_shard(spec, full, 2, rank), group=dist.group.WORLD, record_routing=True
            ),
        }
        for key, params in settings.items():
            for t_g, engine in engines.items():
                b = engine.generate(PROMPTS, params)
                out[(name, key, t_g)] = (b.response_ids, b.logprobs, b.finish_reasons, b.routing)
    return out


def test_moe_tg2_equals_tg1():
    results = run_distributed(worker, 2, MODELS, timeout_s=300)
    worst = 0.0
    for name in MODELS:
        for key in ("sample", "greedy_stop"):
            ids, lp, fin, routing = results[0][(name, key, 1)]
            for rank in range(2):
                ids2, lp2, fin2, routing2 = results[rank][(name, key, 2)]
                assert torch.equal(ids2, ids) and fin2 == fin, (name, key, rank)
                assert all(torch.equal(a, b) for a, b in zip(routing2, routing, strict=True))
                worst = max(worst, (lp2 - lp).abs().max().item())
    assert worst <= LOGPROB_TOL, worst
