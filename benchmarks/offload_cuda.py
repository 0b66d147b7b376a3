"""Offload around generation on the device: a megatron role's parameters, gradient buffer and
optimizer state (bf16 training: fp32 master copies, Adam's two states) leave the device and
come back bit for bit.

On CUDA the bytes freed are measured with `torch.cuda.memory_allocated` and set against what the
role reports (`Offload.to_host`); meanwhile another allocation the size of everything freed fills
the device (as SGLang's KV cache would), and after it the role's tensors equal a host snapshot
byte for byte, and two more training steps equal those of a twin that never offloaded.

A second process (as SGLang's schedulers are) reads the device's free memory with
`torch.cuda.mem_get_info` before the offload, after it, and after `empty_cache`: the freed
storage stays in this process's caching allocator until emptied, so only the last should see
it; it must see at least 90% of the bytes freed.

    python benchmarks/offload_cuda.py --out runs/offload            # CUDA: llama2-7b-shape-1/4
    python benchmarks/offload_cuda.py --out runs/offload --device cpu --model tiny-llama

Writes offload.json into --out and prints it; exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from rl3d.config import OptimConfig
from rl3d.engine import Features, InitialWeights, MegatronEngine, Training
from rl3d.engine.techniques import Offload
from rl3d.models.bootstrap import init_megatron
from rl3d.models.hf_mapping import hf_config_from_spec
from rl3d.models.offload import OFFLOAD_KINDS, kind_tensors
from rl3d.models.spec import get_model_spec
from rl3d.models.weights import save_weights
from rl3d.parallel.layout import ParallelLayout
from rl3d.single_controller.batch import DataBatch
from rl3d.utils.device import init_process_group, synchronize

B, P, R = 4, 64, 64


SECOND_PROCESS_FRACTION = 0.9  # of the bytes freed, seen free by another process after empty_cache


def allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def free_seen_elsewhere(device: torch.device) -> int | None:
    """The device's free bytes as a fresh process reads them (its own CUDA context counted out
    the same way each time); None off CUDA."""
    if device.type != "cuda":
        return None
    code = f"import torch; print(torch.cuda.mem_get_info({device.index or 0})[0])"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    return int(done.stdout.split()[-1])


def train(role: MegatronEngine, step: int) -> None:
    ids = torch.randint(3, role.spec.vocab_size, (B, P + R), generator=torch.Generator().manual_seed(step))
    batch = DataBatch(
        {"input_ids": ids, "attention_mask": torch.ones_like(ids), "responses": ids[:, P:],
         "response_mask": torch.ones(B, R, dtype=torch.long)}
    )  # fmt: skip

    def loss_of(output, micro):
        logits = role.response_slice(output, micro).float()
        return torch.log_softmax(logits, -1).gather(-1, micro["responses"][..., None]).mean().neg(), {}

    role.train_minibatches(batch, mini_batch_size=B, micro_batch_size=2, epochs=1, loss_of=loss_of,
                           count_unit=lambda m: float(m["response_mask"].sum()))  # fmt: skip


def snapshot(role: MegatronEngine) -> list[torch.Tensor]:
    return [
        t.detach().cpu().clone() for k in OFFLOAD_KINDS for t in kind_tensors(role.ddp, role.optimizer, k)
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--model", default="llama2-7b-shape-1/4")
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    init_process_group(args.device, timeout_s=300, rank=0, world_size=1)
    groups = init_megatron(ParallelLayout(1, 1, 1), seed=1)
    device = groups.device
    spec = get_model_spec(args.model)

    def role(offload=(), hf_path=None):
        return MegatronEngine(
            spec,
            groups,
            role="actor",
            params_dtype=torch.bfloat16,
            seed=1,
            training=Training(OptimConfig(lr=1e-4), total_steps=10),
            weights=InitialWeights(hf_path=hf_path),
            features=Features([Offload(offload)] if offload else []),
        )

    with tempfile.TemporaryDirectory() as start:  # one starting point for both (master copies too)
        save_weights(role().model, spec, groups, start, hf_config=hf_config_from_spec(spec).to_dict())
        moved, twin = role(OFFLOAD_KINDS, start), role((), start)
    results: dict = {"model": spec.name, "device": str(device)}
    train(moved, 0)
    train(twin, 0)
    before = snapshot(moved)
    held = moved.offload.device_bytes()
    synchronize(device)
    start = allocated(device)
    seen = {"before": free_seen_elsewhere(device)}
    freed = moved.to_host()
    synchronize(device)
    after_offload = allocated(device)
    seen["after_offload"] = free_seen_elsewhere(device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    seen["after_empty_cache"] = free_seen_elsewhere(device)
    filler = torch.empty(freed, dtype=torch.uint8, device=device).fill_(0xA5)  # the engine's turn
    del filler
    moved.resident()
    synchronize(device)
    restored = allocated(device)
    same = all(torch.equal(a, b.cpu()) for a, b in zip(before, snapshot(moved), strict=True))
    for step in (1, 2):
        train(moved, step)
        train(twin, step)
    trained_same = all(torch.equal(a, b) for a, b in zip(snapshot(twin), snapshot(moved), strict=True))
    results |= {
        "held_bytes": held,
        "reported_freed_bytes": freed,
        "measured_freed_bytes": start - after_offload,
        "measured_restored_bytes": restored - after_offload,
        "round_trip_bit_exact": same,
        "two_steps_after_equal_twin": trained_same,
        "second_process_free_bytes": seen,
    }
    ok = same and trained_same
    if device.type == "cuda":
        gain = seen["after_empty_cache"] - seen["before"]
        results["second_process_sees_freed_fraction"] = gain / freed
        ok = ok and abs(results["measured_freed_bytes"] - freed) <= 0.01 * freed
        ok = ok and gain >= SECOND_PROCESS_FRACTION * freed
    results["ok"] = ok
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "offload.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
