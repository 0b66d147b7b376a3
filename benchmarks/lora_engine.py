"""LoRA in the torch rollout engine: apply vs merge, side by side, in one run.

    python benchmarks/lora_engine.py [--models tiny-llama,smollm2-135m] [--ranks 8,16,64] [--json PATH]
        [--device cuda --dtype bfloat16]

Per model and adapter rank (all seven projections adapted): the per-step update time (median of
`engine.load_lora` over --repeats fresh adapters: parse + fuse + slice, and for merge the
W_base + b @ a rebuild), the decode tokens/s of greedy generation (--batch prompts of
--prompt-len tokens, --new-tokens each) for the base alone, apply and merge, and the ratios
merge / apply. Then the drift of the alternative merge (W += delta, next step W -= delta, in
place) after --drift-steps steps, in fp32 and bf16, on the model's targeted weights, against the
rebuild the engine does (exactly W_base + delta every step). One torch thread on CPU. A model
from the shape registry (llama2-7b, ...) gets random weights made on --device.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from rl3d.models.lora_names import LORA_TARGETS, peft_key
from rl3d.models.lora_shapes import module_shape
from rl3d.rollout import SamplingParams, TorchRolloutEngine
from rl3d.rollout.lora import megatron_low_rank


def model_weights(name: str, device: str, dtype: torch.dtype):
    if name.startswith("smollm2"):
        from rl3d.testing.real_model import megatron_tensors, real_model_dir

        spec, full = megatron_tensors(real_model_dir(name))
        return spec, {k: v.to(device, dtype) for k, v in full.items()}
    from rl3d.hybrid_engine.params import model_params
    from rl3d.models.spec import get_model_spec

    spec = get_model_spec(name)
    gen = torch.Generator(device=device).manual_seed(0)
    full = {}
    for p in model_params(spec, train_tp=1):
        if p.tied_copy:
            continue
        x = torch.randn(p.shape, generator=gen, device=device, dtype=torch.float32)
        scale = 0.15 if spec.hidden_size < 512 else 0.02  # far from uniform next-token odds
        full[p.name] = (1 + 0.1 * x if p.name.endswith("norm.weight") else scale * x).to(dtype)
    return spec, full


def random_adapter(spec, rank: int, seed: int, scale: float = 0.02, device: str = "cpu"):
    gen = torch.Generator(device=device).manual_seed(seed)
    tensors = {}
    for layer in range(spec.num_layers):
        for module in LORA_TARGETS:
            out, inp = module_shape(spec, module)
            for factor, shape in (("A", (rank, inp)), ("B", (out, rank))):
                x = torch.randn(shape, generator=gen, device=device)
                tensors[peft_key(layer, module, factor)] = scale * x
    return tensors, {"r": rank, "lora_alpha": 2 * rank, "target_modules": list(LORA_TARGETS)}


def decode_tokens_per_s(engine, args) -> float:
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(3, engine.spec.vocab_size, (args.batch, args.prompt_len), generator=gen).tolist()
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0)
    engine.generate(prompts, SamplingParams(max_new_tokens=2, temperature=0.0))  # warm-up
    best = float("inf")
    for _ in range(args.gen_repeats):
        sync(args.device)
        start = time.perf_counter()
        engine.generate(prompts, params)
        sync(args.device)
        best = min(best, time.perf_counter() - start)
    return engine.stats.generated_tokens / best


def update_seconds(engine, spec, rank, args) -> float:
    adapters = [random_adapter(spec, rank, seed, device=args.device) for seed in range(args.repeats + 1)]
    engine.load_lora(*adapters[0])  # the merge buffers are allocated once, at the first load
    times = []
    for tensors, config in adapters[1:]:
        sync(args.device)
        start = time.perf_counter()
        engine.load_lora(tensors, config)
        sync(args.device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def drift(spec, weights, rank, steps, dtype) -> dict[str, float]:
    """Max |W - (W_base + delta_last)| after `steps` in-place merge/unmerge steps, vs the rebuild."""
    device = next(iter(weights.values())).device
    adapters = (random_adapter(spec, rank, s, scale=0.05, device=str(device)) for s in range(steps))
    factors = [megatron_low_rank(spec, *adapter) for adapter in adapters]
    names = list(factors[0])
    base = {n: weights[n].to(dtype) for n in names}
    inplace = {n: b.clone() for n, b in base.items()}
    previous = None
    for f in factors:
        for n in names:
            if previous is not None:
                inplace[n] -= previous[n].delta().to(dtype)
            inplace[n] += f[n].delta().to(dtype)
        previous = f
    worst_inplace = worst_rebuild = 0.0
    for n in names:
        exact = base[n].double() + factors[-1][n].delta().double()
        rebuilt = torch.addmm(base[n], factors[-1][n].b.to(dtype), factors[-1][n].a.to(dtype))
        worst_inplace = max(worst_inplace, (inplace[n].double() - exact).abs().max().item())
        worst_rebuild = max(worst_rebuild, (rebuilt.double() - exact).abs().max().item())
    return {"in_place_max_err": worst_inplace, "rebuild_max_err": worst_rebuild}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="tiny-llama,smollm2-135m")
    p.add_argument("--ranks", default="8,16,64")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--gen-repeats", type=int, default=2)
    p.add_argument("--drift-steps", type=int, default=100)
    p.add_argument("--json", default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", help="the engine's weights (drift: fp32 and bf16)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rows, drifts = [], []
    for name in args.models.split(","):
        spec, weights = model_weights(name, args.device, getattr(torch, args.dtype))
        base_tps = decode_tokens_per_s(TorchRolloutEngine(spec, weights), args)
        for rank in map(int, args.ranks.split(",")):
            row = {"model": name, "rank": rank, "base_tok_s": base_tps}
            for mode in ("apply", "merge"):
                engine = TorchRolloutEngine(spec, weights, lora_mode=mode)
                row[f"{mode}_update_s"] = update_seconds(engine, spec, rank, args)
                row[f"{mode}_tok_s"] = decode_tokens_per_s(engine, args)
            row["merge_over_apply_tok_s"] = row["merge_tok_s"] / row["apply_tok_s"]
            row["merge_over_apply_update"] = row["merge_update_s"] / row["apply_update_s"]
            rows.append(row)
            print(
                f"{name} r={rank}: decode tok/s base {base_tps:.0f}, apply {row['apply_tok_s']:.0f}, "
                f"merge {row['merge_tok_s']:.0f} (merge/apply {row['merge_over_apply_tok_s']:.2f}); "
                f"update s apply {row['apply_update_s']:.4f}, merge {row['merge_update_s']:.4f} "
                f"(merge/apply {row['merge_over_apply_update']:.2f})",
                flush=True,
            )
        for dtype in (torch.float32, torch.bfloat16):
            d = {"model": name, "dtype": str(dtype).removeprefix("torch."), "steps": args.drift_steps}
            d.update(drift(spec, weights, 16, args.drift_steps, dtype))
            drifts.append(d)
            print(
                f"{name} {d['dtype']}: after {args.drift_steps} merge/unmerge steps, max error in place "
                f"{d['in_place_max_err']:.3g}, rebuilt from the base {d['rebuild_max_err']:.3g}",
                flush=True,
            )
    if args.device.startswith("cuda"):
        print(f"device {torch.cuda.get_device_name()}, weights {args.dtype}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "drift": drifts, "args": vars(args)}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
