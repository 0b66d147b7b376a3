"""`rl3d bench rollout`: the torch rollout engine against HF `generate`, same model, same batch.

Both run in one process, on the CPU (`--device cuda`: on this process's GPU, each timed call
ending with a device synchronize), on the same random weights (Megatron tensors, converted to
HF names with rl3d's mapping), fp32, under `torch.no_grad()`, on the same prompts (lengths
between prompt_len/2 and prompt_len, so HF gets a left-padded batch with its attention mask).
HF runs batched with its KV cache on (`use_cache=True`, SDPA attention); neither side stops
early (no stop tokens for the engine, `eos_token_id=None` and `min_new_tokens=max_new_tokens`
for HF), so both generate exactly batch x new_tokens tokens. Greedy by default; with
`--temperature > 0` both sample with that temperature and no top-k/top-p filter. Each engine
gets one warm-up call, then `--repeats` timed rounds call both, alternating which goes first
(so load changes on a shared machine hit both alike); tokens/s is batch x new_tokens over the
median wall time of a whole `generate` call (prefill included). The engine also computes the
per-token log-probs RL needs; HF does not. With greedy decoding the result also records the
fraction of rows on which both produced the same tokens (expected: all).

    rl3d bench rollout                       # table; CSV, markdown, PNG in results/rollout/...
    rl3d bench rollout --json --batch 4      # {"torch_tokens_per_s": ..., "hf_tokens_per_s": ...}
    rl3d bench rollout --device cuda         # the same on the GPU
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import logging
import os
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rl3d.models.params import HF_NAMES, OUTPUT_LAYER
from rl3d.models.spec import ModelSpec, get_model_spec

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

# The default measures what the engine itself controls: per-step work around the matmuls (KV
# cache, masks, RoPE, sampling, Python). On tiny-llama (2 layers, hidden 64) that is most of the
# time, and a run takes seconds. On CPU, bigger shapes mostly time the same fp32 GEMMs in both
# engines, so the ratio tends to 1 (e.g. llama2-7b-shape-1/16, 32 layers of hidden 256: ~1.2x);
# pass --model to see that regime. One thread by default: these matrices are far too small for
# intra-op parallelism to pay, and a second thread on a busy machine stalls every parallel op.
DEFAULT_MODEL = "tiny-llama"


def add_rollout_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"an rl3d model name (rl3d.models.get_model_spec), random weights (default {DEFAULT_MODEL})",
    )
    parser.add_argument("--batch", type=int, default=16, help="prompts generated together")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens generated per prompt")
    parser.add_argument("--prompt-len", type=int, default=32, help="longest prompt (shortest: half)")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per engine (median)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--seed", type=int, default=0, help="weights, prompts and sampling seed")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where both engines run")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--out", default=None, help="results folder (default results/rollout/<name>)")


def _check_args(args: argparse.Namespace, spec: ModelSpec) -> None:
    for key in ("batch", "new_tokens", "prompt_len", "repeats"):
        if getattr(args, key) < 1:
            raise ValueError(f"--{key.replace('_', '-')} must be >= 1, got {getattr(args, key)}")
    if args.threads < 0:
        raise ValueError(f"--threads must be >= 0 (0: torch's default), got {args.threads}")
    if args.temperature < 0:
        raise ValueError(f"--temperature must be >= 0, got {args.temperature}")
    if args.device == "cuda":
        from rl3d.utils.device import cuda_available  # torch: not at import (`rl3d plan` needs none)

        if not cuda_available():
            raise ValueError("--device cuda: no CUDA device here")
    if args.prompt_len + args.new_tokens > spec.max_position_embeddings:
        raise ValueError(
            f"--prompt-len + --new-tokens = {args.prompt_len + args.new_tokens} exceeds "
            f"{spec.name}'s max_position_embeddings={spec.max_position_embeddings}"
        )


def random_weights(spec: ModelSpec, seed: int) -> dict[str, torch.Tensor]:
    """Random full (t=1) Megatron fp32 tensors: matrices ~ N(0, 1/hidden), norms around 1."""
    import torch

    from rl3d.hybrid_engine.params import model_params
    from rl3d.hybrid_engine.weights import full_model

    full = full_model(model_params(spec, train_tp=1), seed=seed, dtype=torch.float32)
    std = spec.hidden_size**-0.5
    full = {k: (1 + 0.1 * v) if k.endswith("norm.weight") else std * v for k, v in full.items()}
    if spec.tied_embeddings:
        full.pop(OUTPUT_LAYER)
    return full


def hf_model(spec: ModelSpec, full: dict[str, torch.Tensor]) -> Any:
    """The same weights as a `transformers` causal LM (fp32, SDPA attention, eval mode)."""
    import torch
    from transformers import AutoModelForCausalLM

    from rl3d.models.hf_mapping import hf_config_from_spec
    from rl3d.rollout.sglang_weights import megatron_to_hf

    state = {k: v for name, t in full.items() for k, v in megatron_to_hf(spec, name, [t])}
    config = hf_config_from_spec(spec)
    config._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= (set(HF_NAMES[OUTPUT_LAYER]) if spec.tied_embeddings else set())
    if spec.tied_embeddings:
        model.tie_weights()
    return model.eval()


def make_prompts(spec: ModelSpec, batch: int, prompt_len: int, seed: int) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    shortest = max(1, prompt_len // 2)
    lengths = torch.randint(shortest, prompt_len + 1, (batch,), generator=gen).tolist()
    lengths[0] = prompt_len  # the batch always reaches the stated width
    return [torch.randint(0, spec.vocab_size, (n,), generator=gen).tolist() for n in lengths]


def _left_padded(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.int64)
    mask = torch.zeros(len(prompts), width, dtype=torch.int64)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    return ids, mask


def _timed(fns: dict[str, Any], repeats: int) -> tuple[dict[str, list[float]], dict[str, Any]]:
    """One warm-up call each (allocations, first-call dispatch, kernel selection), then `repeats`
    rounds that call every function once, alternating their order, so that a change in machine
    load during the run affects all of them alike."""
    outs = {name: fn() for name, fn in fns.items()}
    seconds: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(repeats):
        for name in list(fns)[:: 1 if r % 2 == 0 else -1]:
            start = time.perf_counter()
            outs[name] = fns[name]()
            seconds[name].append(time.perf_counter() - start)
    return seconds, outs


def measure(
    spec: ModelSpec,
    *,
    batch: int,
    new_tokens: int,
    prompt_len: int,
    repeats: int,
    temperature: float = 0.0,
    seed: int = 0,
    device: str = "cpu",
) -> dict[str, Any]:
    """Time both engines on the same weights and prompts; returns per-engine seconds and tokens."""
    import torch

    from rl3d.rollout import SamplingParams, TorchRolloutEngine
    from rl3d.utils.device import synchronize

    where = torch.device(device)
    full = {k: v.to(where) for k, v in random_weights(spec, seed).items()}
    prompts = make_prompts(spec, batch, prompt_len, seed)
    pad_id = 0
    engine = TorchRolloutEngine(spec, full, max_batch_rows=batch, pad_token_id=pad_id)
    params = SamplingParams(temperature=temperature, max_new_tokens=new_tokens, seed=seed)
    model = hf_model(spec, full).to(where)
    ids, mask = (t.to(where) for t in _left_padded(prompts, pad_id))
    sampling = {"do_sample": False}
    if temperature > 0:
        sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}

    def run_torch() -> list[list[int]]:
        responses = engine.generate(prompts, params).responses()
        synchronize(where)
        return responses

    def run_hf() -> list[list[int]]:
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                eos_token_id=None,
                pad_token_id=pad_id,
                use_cache=True,
                **sampling,
            )
        synchronize(where)
        return out[:, ids.shape[1] :].tolist()

    seconds, outs = _timed({"torch": run_torch, "hf": run_hf}, repeats)
    ours, theirs = outs["torch"], outs["hf"]
    assert all(len(r) == new_tokens for r in ours + theirs), "an engine stopped early"
    tokens = batch * new_tokens
    result = {
        "model": spec.name,
        "batch": batch,
        "new_tokens": new_tokens,
        "prompt_lengths": [len(p) for p in prompts],
        "temperature": temperature,
        "device": device,
        "threads": torch.get_num_threads(),
        "engines": {
            name: {
                "seconds": s,
                "median_s": statistics.median(s),
                "tokens_per_s": tokens / statistics.median(s),
            }
            for name, s in seconds.items()
        },
    }
    if temperature == 0:  # greedy: the two engines should agree token for token
        result["greedy_rows_equal"] = sum(a == b for a, b in zip(ours, theirs)) / batch
    return result


def _results_dir(args: argparse.Namespace, spec: ModelSpec) -> Path:
    if args.out:
        return Path(args.out)
    import torch

    safe = spec.name.replace("/", "_")
    hardware = "cuda" if args.device == "cuda" else f"cpu{os.cpu_count()}-{torch.get_num_threads()}threads"
    return Path("results") / "rollout" / f"{safe}_{hardware}_{datetime.date.today().isoformat()}"


def _write(result: dict[str, Any], out: Path) -> str:
    rows = [
        {
            "engine": name,
            "model": result["model"],
            "batch": result["batch"],
            "new_tokens": result["new_tokens"],
            "threads": result["threads"],
            "median_s": e["median_s"],
            "tokens_per_s": e["tokens_per_s"],
            "seconds": " ".join(f"{s:.4f}" for s in e["seconds"]),
        }
        for name, e in result["engines"].items()
    ]
    with open(out / "rollout.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    torch_tps, hf_tps = (result["engines"][k]["tokens_per_s"] for k in ("torch", "hf"))
    lines = [
        f"model {result['model']}, batch {result['batch']}, {result['new_tokens']} new tokens, "
        f"prompts {min(result['prompt_lengths'])}-{max(result['prompt_lengths'])} tokens, "
        f"temperature {result['temperature']}, fp32, "
        + ("on the GPU" if result["device"] == "cuda" else f"{result['threads']} CPU threads"),
        "",
        "| engine | median s | tokens/s |",
        "|---|---|---|",
    ]
    lines += [f"| {r['engine']} | {r['median_s']:.4f} | {r['tokens_per_s']:.1f} |" for r in rows]
    lines += ["", f"torch engine / HF generate: {torch_tps / hf_tps:.2f}x"]
    if "greedy_rows_equal" in result:
        lines.append(f"greedy rows identical in both: {100 * result['greedy_rows_equal']:.0f}%")
    _plot(rows, result, out / "rollout.png")
    return "\n".join(lines)


def _plot(rows: list[dict], result: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib
    except ImportError:  # the PNG is optional
        logger.info("matplotlib not installed: no rollout.png")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 4))
    labels = {"torch": "rl3d torch engine", "hf": "HF generate"}
    ax.bar([labels[r["engine"]] for r in rows], [r["tokens_per_s"] for r in rows], color=["C0", "C1"])
    ax.set_ylabel("generated tokens/s (median)")
    ratio = rows[0]["tokens_per_s"] / rows[1]["tokens_per_s"]
    ax.set_title(
        f"{result['model']}, batch {result['batch']} x {result['new_tokens']} tokens, "
        f"{result['device'].upper()} fp32: {ratio:.2f}x"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_rollout_bench(args: argparse.Namespace) -> str:
    spec = get_model_spec(args.model)
    _check_args(args, spec)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    result = measure(
        spec,
        batch=args.batch,
        new_tokens=args.new_tokens,
        prompt_len=args.prompt_len,
        repeats=args.repeats,
        temperature=args.temperature,
        seed=args.seed,
        device=args.device,
    )
    out = _results_dir(args, spec)
    out.mkdir(parents=True, exist_ok=True)
    table = _write(result, out)
    (out / "rollout.md").write_text(table + "\n")
    (out / "result.json").write_text(json.dumps(result, indent=1))
    if args.json:
        contract = {
            "torch_tokens_per_s": result["engines"]["torch"]["tokens_per_s"],
            "hf_tokens_per_s": result["engines"]["hf"]["tokens_per_s"],
            "model": result["model"],
            "batch": result["batch"],
            "new_tokens": result["new_tokens"],
        }
        return json.dumps(contract)
    return f"{table}\nresults in {out}"
