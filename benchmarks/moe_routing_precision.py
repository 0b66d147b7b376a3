"""How often a bf16 rollout engine routes tokens to other experts than fp32 does, without replay.

    python benchmarks/moe_routing_precision.py [--size tiny|small] [--prompts 32] [--n 4] [--json]

The bf16 torch engine samples responses (temperature 1) with `record_routing=True`; the fp32
engine then runs every prompt + response as one prefill (what a trainer's forward sees) and
records its routing of the same tokens. Reported: the fraction of routing decisions (token,
layer) whose top-k expert sets differ (`rl3d.rollout.moe.topk_set_mismatch`), prompt and
response tokens apart. Random weights as in `moe_decode.py` (the router runs in fp32 in both
engines; what differs is the bf16 hidden states it reads).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from moe_decode import SIZES, random_weights

from rl3d.rollout import SamplingParams, TorchRolloutEngine
from rl3d.rollout.moe import topk_set_mismatch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    spec = SIZES[args.size]
    weights = random_weights(spec)
    gen = torch.Generator().manual_seed(1)
    prompts = [
        torch.randint(0, spec.vocab_size, (16 + i % 17,), generator=gen).tolist() for i in range(args.prompts)
    ]
    with torch.inference_mode():
        bf16 = TorchRolloutEngine(spec, weights, dtype=torch.bfloat16, record_routing=True)
        batch = bf16.generate(prompts, SamplingParams(max_new_tokens=args.new_tokens, n=args.n, seed=2))
        full = [prompts[int(i)] + r for i, r in zip(batch.prompt_index, batch.responses())]
        fp32 = TorchRolloutEngine(spec, weights, record_routing=True)
        ref = fp32.generate(full, SamplingParams(max_new_tokens=1, temperature=0.0))
    prompt_part, response_part = [], []
    for row, (seq, rec) in enumerate(zip(full, batch.routing)):
        plen = len(prompts[int(batch.prompt_index[row])])
        ref_rec = ref.routing[row][: len(seq)]  # the fp32 prefill's routing of the same tokens
        prompt_part.append((rec[:plen], ref_rec[:plen]))
        response_part.append((rec[plen:], ref_rec[plen:]))
    result = {"size": args.size, "samples": len(full), "loadavg": os.getloadavg()[0]}
    for key, pairs in (("prompt", prompt_part), ("response", response_part)):
        a = torch.cat([p[0] for p in pairs])
        b = torch.cat([p[1] for p in pairs])
        result[f"{key}_decisions"] = a.shape[0] * a.shape[1]
        result[f"{key}_topk_mismatch"] = round(topk_set_mismatch(a, b), 5)
    if args.json:
        print(json.dumps(result))
        return
    print(f"{spec.name}: bf16 engine vs fp32 engine routing, {len(full)} samples")
    for key in ("prompt", "response"):
        print(
            f"  {key}: {result[f'{key}_topk_mismatch']:.3%} of {result[f'{key}_decisions']} decisions differ"
        )


if __name__ == "__main__":
    main()
