"""The torch rollout engine on a mixture of experts against a dense model of equal active MLP
width, and the per-expert MoE layer against computing every expert for every token.

    python benchmarks/moe_decode.py [--size tiny|small] [--batch 16] [--new-tokens 64] [--json]

Both models share attention (Qwen3: q/k norm, head width 32 or 64) and differ in the MLP only:
the MoE has E experts of width fe, top-k; the dense one a SwiGLU of width k x fe (the same
active MLP weights per token, less the router's E x h). Random weights (~0.15, norms ~1),
fp32, one thread, greedy, no stop tokens: batch x new_tokens tokens per call. One warm-up call,
then `--repeats` rounds alternating which model goes first; tokens/s over the median wall time
of a whole `generate` (prefill included). The layer part times one MoE MLP call (per expert:
`rl3d.rollout.moe.moe_mlp`) and the same output computed for all E experts with batched
matmuls, at several token counts (1 row per sequence in decode, a prompt's tokens in prefill).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import replace

import torch
import torch.nn.functional as F

from rl3d.models.params import model_params
from rl3d.models.spec import ModelSpec
from rl3d.rollout import SamplingParams, TorchRolloutEngine
from rl3d.rollout.moe import engine_param_names, moe_mlp, moe_weights, route

SIZES = {  # (MoE spec; the dense twin replaces the experts by one MLP of width k x fe)
    "tiny": ModelSpec(
        "tiny-qwen3-moe", 2, 64, 128, 4, 2, 256, rope_theta=1e6, norm_eps=1e-6, max_position_embeddings=512,
        kv_channels=32, qk_norm=True, num_experts=8, moe_ffn_hidden_size=32, moe_top_k=2,
    ),
    "small": ModelSpec(
        "small-qwen3-moe", 4, 512, 1024, 8, 4, 2048, rope_theta=1e6, norm_eps=1e-6,
        max_position_embeddings=512, kv_channels=64, qk_norm=True, num_experts=16,
        moe_ffn_hidden_size=256, moe_top_k=4,
    ),
}  # fmt: skip


def dense_twin(spec: ModelSpec) -> ModelSpec:
    width = spec.moe_top_k * spec.moe_ffn_hidden_size
    return replace(spec, name=spec.name.replace("moe", "dense"), num_experts=0, moe_top_k=0,
                   moe_ffn_hidden_size=0, ffn_hidden_size=width)  # fmt: skip


def random_weights(spec: ModelSpec, seed: int = 0) -> dict[str, torch.Tensor]:
    """Every tensor the engine reads, random (the inventory's shapes; the q/k-norm and MoE ones by suffix)."""
    h, hd, fe = spec.hidden_size, spec.head_dim, spec.moe_ffn_hidden_size
    shapes = {p.name: p.shape for p in model_params(spec, train_tp=1)}
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name in engine_param_names(spec):
        if name not in shapes:
            shapes[name] = (
                (hd,) if "layernorm" in name
                else (spec.num_experts, h) if name.endswith("router.weight")
                else (2 * fe, h) if name.endswith("linear_fc1.weight")
                else (h, fe)
            )  # fmt: skip
        t = torch.randn(shapes[name], generator=gen)
        out[name] = 1 + 0.1 * t if name.endswith("norm.weight") else 0.15 * t
    if spec.tied_embeddings:
        out.pop("output_layer.weight", None)
    return out


def time_generate(engines, prompts, params, repeats):
    for e in engines.values():
        e.generate(prompts, params)  # warm-up
    walls = {k: [] for k in engines}
    order = list(engines)
    for r in range(repeats):
        for k in order if r % 2 == 0 else order[::-1]:
            t0 = time.perf_counter()
            engines[k].generate(prompts, params)
            walls[k].append(time.perf_counter() - t0)
    tokens = len(prompts) * params.max_new_tokens
    return {k: tokens / statistics.median(w) for k, w in walls.items()}


def all_experts(h, mw, spec):
    """The MoE layer computing every expert for every token (t_g = 1), weighting by the router."""
    top_w, top_ids = route(h, mw, spec)
    weights = torch.zeros(h.shape[0], spec.num_experts, dtype=h.dtype).scatter_(1, top_ids, top_w)
    w1 = torch.stack([p[0] for p in mw.fc1])  # [E, 2fe, h]
    w2 = torch.stack([p[0] for p in mw.fc2])  # [E, h, fe]
    gate_up = torch.matmul(h, w1.transpose(1, 2))  # [E, N, 2fe]
    gate, up = gate_up.chunk(2, dim=-1)
    y = torch.matmul(F.silu(gate) * up, w2.transpose(1, 2))  # [E, N, h]
    return torch.einsum("enh,ne->nh", y, weights)


def time_layer(spec, tensors, tokens, repeats=50):
    pieces = {n: [t] for n, t in tensors.items()}
    mw = moe_weights(pieces, spec, 0)
    out = {}
    for n in tokens:
        h = torch.randn(n, spec.hidden_size)
        ours, dense = moe_mlp(h, mw, spec), all_experts(h, mw, spec)
        assert (ours - dense).abs().max() <= 1e-5 * ours.abs().max(), "the two MoE layers differ"
        for name, fn in (("per_expert", moe_mlp), ("all_experts", all_experts)):
            fn(h, mw, spec)
            t0 = time.perf_counter()
            for _ in range(repeats):
                fn(h, mw, spec)
            out[(name, n)] = (time.perf_counter() - t0) / repeats * 1e6  # microseconds
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    spec = SIZES[args.size]
    dense = dense_twin(spec)
    weights = {s.name: random_weights(s) for s in (spec, dense)}
    engines = {s.name: TorchRolloutEngine(s, weights[s.name]) for s in (spec, dense)}
    gen = torch.Generator().manual_seed(1)
    prompts = [
        torch.randint(0, spec.vocab_size, (16 + i % 17,), generator=gen).tolist() for i in range(args.batch)
    ]
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0)
    with torch.inference_mode():
        tps = time_generate(engines, prompts, params, args.repeats)
        layer = time_layer(spec, weights[spec.name], tokens=(1, 16, 64, 512))
    result = {
        "size": args.size, "batch": args.batch, "new_tokens": args.new_tokens,
        "moe_tokens_per_s": round(tps[spec.name], 1), "dense_tokens_per_s": round(tps[dense.name], 1),
        "layer_us": {f"{k}@{n}": round(v, 1) for (k, n), v in layer.items()},
        "loadavg": os.getloadavg()[0],
    }  # fmt: skip
    if args.json:
        print(json.dumps(result))
        return
    load = result["loadavg"]
    print(f"{spec.name} vs {dense.name}, batch {args.batch}, {args.new_tokens} new tokens, load {load:.1f}")
    print(f"  decode tokens/s: MoE {result['moe_tokens_per_s']}, dense {result['dense_tokens_per_s']}")
    for n in (1, 16, 64, 512):
        print(f"  MoE layer, {n} tokens: per expert {layer[('per_expert', n)]:.0f} us, "
              f"all experts {layer[('all_experts', n)]:.0f} us")  # fmt: skip


if __name__ == "__main__":
    main()
