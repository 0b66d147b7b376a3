"""Achieved bandwidth of each resharding kernel form against a plain device-to-device copy.

For every op on one llama2-70b-shaped decoder layer (optionally scaled down), every available
form (torch reference, Triton, CUDA extension) is timed, and its bytes read + written per second
are set against `copy_` of a contiguous buffer moving the same bytes: the physical limit. On a
GPU the Triton and CUDA forms should reach 80% of it.

    python benchmarks/kernel_bandwidth.py --out runs/bench            # GPU: full layer; CPU: scale 8
    python benchmarks/kernel_bandwidth.py --out runs/bench --scale 1 --train-tp 8 --gen-tp 2

On CPU only the torch reference is a performance path; `--backends triton` there runs Triton's
interpreter (needs TRITON_INTERPRET=1) and is only useful with a large --scale, as a smoke test.
"""

from __future__ import annotations

import argparse
import csv
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from rl3d.ops import (
    GatheredShards,
    ParamLayout,
    ShardKind,
    gather_to_layout,
    pack_bucket,
    padded_vocab_size,
    shard_for_tp,
    strided_copy,
    unpack_bucket,
)

# llama2-70b (MODELS.md): hidden 8192, ffn 28672, 64 heads, 8 KV heads, vocab 32000.
HIDDEN, FFN, HEADS, KV_HEADS, VOCAB = 8192, 28672, 64, 8, 32000
TARGET_FRACTION = 0.8


@dataclass
class Op:
    name: str
    run: Callable[[str], object]  # backend -> result
    bytes_moved: int  # read + written


def layer_tensors(scale: int, train_tp: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Full fp32 tensors of one layer plus the output embedding; head_dim shrinks with `scale`."""
    head_dim = HIDDEN // HEADS // scale
    hidden, ffn = HIDDEN // scale, FFN // scale
    qkv_rows = KV_HEADS * (HEADS // KV_HEADS + 2) * head_dim
    generator = torch.Generator(device=device).manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, device=device)

    vocab_rows = padded_vocab_size(VOCAB // scale, train_tp)
    return {
        "qkv": randn(qkv_rows, hidden),
        "proj": randn(hidden, HEADS * head_dim),
        "fc1": randn(2 * ffn, hidden),
        "fc2": randn(hidden, ffn),
        "embedding": randn(vocab_rows, hidden),
    }


LAYOUTS = {
    "qkv": ParamLayout(kind=ShardKind.QKV, num_heads=HEADS, num_query_groups=KV_HEADS),
    "proj": ParamLayout(kind=ShardKind.ROW),
    "fc1": ParamLayout(kind=ShardKind.SWIGLU_FC1),
    "fc2": ParamLayout(kind=ShardKind.ROW),
}


def build_ops(args: argparse.Namespace, device: torch.device) -> list[Op]:
    full = layer_tensors(args.scale, args.train_tp, device)
    layouts = {**LAYOUTS, "embedding": ParamLayout(kind=ShardKind.VOCAB, vocab_size=VOCAB // args.scale)}
    num_shards = args.train_tp // args.gen_tp
    bf16 = torch.bfloat16
    ops = []
    for name, target in [("qkv", "hf"), ("fc1", "hf"), ("proj", "megatron"), ("fc2", "megatron"),
                         ("embedding", "hf")]:  # fmt: skip
        layout = layouts[name]
        shards = [shard_for_tp(full[name], layout.kind, args.train_tp, r).to(bf16) for r in range(num_shards)]
        # The executor's all-gather output: the shards back to back in one flat buffer.
        window = GatheredShards(
            torch.cat([s.reshape(-1) for s in shards]), tuple(shards[0].shape), num_shards
        )
        gather_args = dict(train_tp=args.train_tp, gen_tp=args.gen_tp, gen_rank=0, target=target)
        out = gather_to_layout(window, layout, backend="torch", **gather_args)
        fused = torch.cat(out) if isinstance(out, tuple) else out
        destination = torch.empty_like(fused)

        def run(backend, window=window, layout=layout, gather_args=gather_args, destination=destination):
            return gather_to_layout(window, layout, out=destination, backend=backend, **gather_args)

        ops.append(Op(f"gather {name}->{target}", run, 2 * fused.numel() * fused.element_size()))

    # Sender side: one training rank's shards of the layer into one send bucket, fp32 -> bf16.
    own = [shard_for_tp(full[n], LAYOUTS[n].kind, args.train_tp, 0).contiguous() for n in LAYOUTS]
    numel = sum(t.numel() for t in own)
    bucket_bf16 = torch.empty(numel, dtype=bf16, device=device)
    own_bf16 = [t.to(bf16) for t in own]
    engine_fp32 = [torch.empty_like(t) for t in own]
    ops.append(
        Op("pack fp32->bf16", lambda b: pack_bucket(own, dtype=bf16, out=bucket_bf16, backend=b), 6 * numel)
    )
    ops.append(Op("pack bf16", lambda b: pack_bucket(own_bf16, out=bucket_bf16, backend=b), 4 * numel))
    ops.append(
        Op("unpack bf16->fp32", lambda b: unpack_bucket(bucket_bf16, engine_fp32, backend=b), 6 * numel)
    )

    # Receiver side: the gathered q rows written straight into an engine's fused qkv parameter.
    fused_qkv = torch.empty(
        full["qkv"].shape[0] // args.gen_tp, full["qkv"].shape[1], dtype=bf16, device=device
    )
    q_rows = HEADS * (HIDDEN // HEADS // args.scale) // args.gen_tp
    q_src = full["qkv"][:q_rows].to(bf16)
    ops.append(
        Op(
            "strided_copy q->qkv_proj",
            lambda b: strided_copy(q_src, fused_qkv[:q_rows], backend=b),
            4 * q_src.numel(),
        )
    )
    return ops


def timed(fn: Callable[[], object], device: torch.device, iters: int) -> float:
    """Best seconds per call after warm-up (first calls compile kernels / build extensions). The
    best, as timeit does, because other processes only ever add time."""
    for _ in range(2):
        fn()
    samples = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        samples.append(time.perf_counter() - start)
    return min(samples)


def copy_seconds(num_bytes: int, device: torch.device, iters: int) -> float:
    """A plain contiguous copy that reads and writes `num_bytes` in total."""
    src = torch.empty(num_bytes // 2, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return timed(lambda: dst.copy_(src), device, iters)


def default_backends(device: torch.device) -> list[str]:
    if device.type != "cuda":
        return ["torch"]
    from rl3d.ops import cuda_ext
    from rl3d.ops.dispatch import triton_importable

    return (
        ["torch"] + (["triton"] if triton_importable() else []) + (["cuda"] if cuda_ext.available() else [])
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for kernels.csv")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--scale", type=int, default=0, help="divide hidden/ffn/head_dim/vocab (0: 1 on GPU, 8 on CPU)"
    )
    parser.add_argument("--train-tp", type=int, default=8)
    parser.add_argument("--gen-tp", type=int, default=2)
    parser.add_argument("--iters", type=int, default=0, help="timed calls per op (0: 20 on GPU, 15 on CPU)")
    parser.add_argument("--backends", default="", help="comma-separated, default: every available form")
    args = parser.parse_args()
    device = torch.device(args.device)
    args.scale = args.scale or (1 if device.type == "cuda" else 8)
    iters = args.iters or (20 if device.type == "cuda" else 15)
    backends = args.backends.split(",") if args.backends else default_backends(device)
    if "triton" in backends and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("Triton on CPU runs only under TRITON_INTERPRET=1 (and is no performance path)")

    rows = []
    for op in build_ops(args, device):
        copy_gbps = op.bytes_moved / copy_seconds(op.bytes_moved, device, iters) / 1e9
        for backend in backends:
            seconds = timed(lambda op=op, backend=backend: op.run(backend), device, iters)
            gbps = op.bytes_moved / seconds / 1e9
            rows.append(
                dict(device=str(device), scale=args.scale, train_tp=args.train_tp, gen_tp=args.gen_tp,
                     op=op.name, backend=backend, mbytes=op.bytes_moved / 1e6, ms=seconds * 1e3,
                     gbps=gbps, copy_gbps=copy_gbps, of_copy=gbps / copy_gbps)
            )  # fmt: skip

    header = f"{'op':28} {'backend':8} {'MB':>9} {'ms':>9} {'GB/s':>8} {'copy GB/s':>10} {'of copy':>8}"
    print(f"device={device} scale={args.scale} train_tp={args.train_tp} gen_tp={args.gen_tp}")
    print(header)
    for row in rows:
        print(f"{row['op']:28} {row['backend']:8} {row['mbytes']:9.1f} {row['ms']:9.3f} {row['gbps']:8.1f} "
              f"{row['copy_gbps']:10.1f} {row['of_copy']:8.0%}")  # fmt: skip
    if device.type == "cuda":
        slow = [r for r in rows if r["backend"] != "torch" and r["of_copy"] < TARGET_FRACTION]
        print(f"target: Triton/CUDA >= {TARGET_FRACTION:.0%} of copy; below it: {len(slow)} of {len(rows)}")
    else:
        print(
            "note: CPU run; only the torch reference is a performance path here (Triton would run in "
            "its interpreter, CUDA not at all)"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "kernels.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


if __name__ == "__main__":
    main()
