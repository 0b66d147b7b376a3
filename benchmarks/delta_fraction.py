"""How much of a bf16 model changes in one optimizer step, and what a delta weight sync
(`rollout.weight_update: delta`, `rl3d.weight_sync.delta`) sends instead of the full weights.

SmolLM2-135M (`rl3d models fetch smollm2-135m`) as fp32 master weights, a real forward and
backward on a small batch of text, and torch's Adam (betas 0.9/0.999, eps 1e-8, no weight
decay) at each learning rate: two steps from the pretrained weights. After each step the bf16
cast of the weights (what a sync sends) is compared bit for bit with the one before, bucket by
bucket as the weight sync cuts them (`--bucket-mb`, every parameter in order), and each bucket
is encoded by the sync's own codec (`encode`: bitmask, index list or full, the smallest),
decoded and checked bit for bit; the codec's seconds on the CPU are columns too. Adam's first
step moves every element with a gradient by about lr (m/sqrt(v) = sign(g)), so step 1 is the
densest; step 2 is what later steps look like.

    python benchmarks/delta_fraction.py --out benchmarks/delta_fraction   # CPU, 5 minutes on 2 busy cores

Writes delta_fraction.csv and delta_fraction.md into --out.
"""

from __future__ import annotations

import argparse
import csv
import os
import time
from pathlib import Path

import torch

from rl3d.weight_sync.delta import HEADER_BYTES, KIND_NAMES, VERSION_BYTES, decode, encode

TEXT = [
    "The rollout engine generates responses while the trainer updates the policy on earlier samples.",
    "In bf16 a weight keeps its value unless the update is at least half a unit in its last place.",
    "Reinforcement learning from verifiable rewards scores each sampled answer against a checker.",
    "A weight sync moves the trainer's new parameters to the inference engine after every step.",
]


def _buckets(flat_bf16: torch.Tensor, bucket_elems: int) -> list[tuple[int, int]]:
    n = flat_bf16.numel()
    return [(lo, min(lo + bucket_elems, n)) for lo in range(0, n, bucket_elems)]


def measure(before: torch.Tensor, after: torch.Tensor, bucket_elems: int) -> dict[str, float]:
    """One sync of `after` to an engine holding `before` (both flat bf16)."""
    changed = wire = 0
    encode_s = decode_s = 0.0
    kinds: dict[str, int] = {}
    for lo, hi in _buckets(after, bucket_elems):
        t0 = time.perf_counter()
        enc = encode(after[lo:hi], before[lo:hi])
        t1 = time.perf_counter()
        out = torch.empty_like(after[lo:hi])
        decode(enc.kind, enc.changed, enc.payload, before[lo:hi], out)
        encode_s, decode_s = encode_s + t1 - t0, decode_s + time.perf_counter() - t1
        assert torch.equal(out.view(torch.int16), after[lo:hi].view(torch.int16))
        changed += enc.changed
        wire += enc.payload.numel() + HEADER_BYTES + VERSION_BYTES
        kinds[KIND_NAMES[enc.kind]] = kinds.get(KIND_NAMES[enc.kind], 0) + 1
    full = after.numel() * after.element_size()
    return {
        "elements": after.numel(),
        "changed": changed,
        "changed_fraction": changed / after.numel(),
        "full_bytes": full,
        "delta_bytes": wire,
        "delta_over_full": wire / full,
        "buckets": " ".join(f"{k}:{n}" for k, n in sorted(kinds.items())),
        "encode_s": round(encode_s, 3),
        "decode_s": round(decode_s, 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--lrs", type=float, nargs="+", default=[1e-6, 1e-5, 2e-5])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--bucket-mb", type=float, default=64.0)  # rollout.async.bucket_mb's default
    ap.add_argument("--model", default="smollm2-135m")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rl3d.models.hub import resolve_model_path

    path = resolve_model_path(args.model)  # a known model's fetched directory, or a path
    tok = AutoTokenizer.from_pretrained(path)
    batch = tok(TEXT, return_tensors="pt", padding=True)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    bucket_elems = int(args.bucket_mb * 2**20) // 2
    rows = []
    start = time.monotonic()
    for lr in args.lrs:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]  # a tied embedding counts once
        opt = torch.optim.Adam(params, lr=lr)
        cast = torch.cat([p.detach().reshape(-1).to(torch.bfloat16) for p in params])
        for step in range(1, args.steps + 1):
            opt.zero_grad()
            loss = model(**batch, labels=labels).loss
            loss.backward()
            opt.step()
            now = torch.cat([p.detach().reshape(-1).to(torch.bfloat16) for p in params])
            row = {"model": args.model, "lr": lr, "step": step, "loss": round(loss.item(), 4)}
            rows.append(row | measure(cast, now, bucket_elems))
            cast = now
            print({k: v for k, v in rows[-1].items()}, flush=True)  # noqa: T201
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "delta_fraction.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    load = os.getloadavg()[0]
    lines = [
        f"SmolLM2-135M ({rows[0]['elements']:,} bf16 elements), Adam, batch of {len(TEXT)} sentences, "
        f"buckets of {args.bucket_mb:g} MiB; {time.monotonic() - start:.0f} s on {os.cpu_count()} CPUs "
        f"at load average {load:.1f}",
        "",
        "| lr | step | changed elements | delta bytes / full bytes | delta MB | full MB | buckets "
        "| encode s | decode s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['lr']:g} | {r['step']} | {100 * r['changed_fraction']:.2f}% | "
            f"{r['delta_over_full']:.3f} | {r['delta_bytes'] / 1e6:.1f} | {r['full_bytes'] / 1e6:.1f} | "
            f"{r['buckets']} | {r['encode_s']:.2f} | {r['decode_s']:.2f} |"
        )
    (args.out / "delta_fraction.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))  # noqa: T201


if __name__ == "__main__":
    main()
