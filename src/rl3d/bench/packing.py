"""`rl3d bench packing`: the actor's forward+backward on padded against packed micro-batches.

One process (a gloo world of one, layout 1-1-1), fp32, two megatron actors with the same random
weights: one padded (`--micro-batch-size` sequences per micro-batch, every row as wide as the
batch), one packed (`packing: true` with a token budget, `--max-tokens`, default the longest
sequence). The batch is length-skewed: prompts of `--prompt-len`/2 .. `--prompt-len` tokens,
response lengths drawn log-normally (median `--median-response`, sigma `--sigma`, capped at
`--max-response`); the longest / median response length is reported and must reach 8. Each
side gets one warm-up call, then `--repeats` rounds time both, alternating which goes first;
seconds are medians. `padded_tokens` are the token slots the padded side computes (B x T),
`packed_tokens` the real tokens; `max_abs_logp_diff` compares the two actors' response
log-probs (forward only, masked to the response tokens).

Balance (token counts, no timing): the batch's tokens over `--dp` data-parallel ranks, dealt in
contiguous chunks (the padded dispatch) against the token-balanced dispatch of packing roles, and
the packed micro-batches under the budget, first-fit decreasing against balanced; each as the
largest load over the mean load (`*_imbalance_*`, 1.0 = even), in the text output; `--json`
prints exactly the timing contract.

    rl3d bench packing --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

MIN_SKEW = 8.0


def add_packing_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny-llama", help="an rl3d model name, random weights")
    parser.add_argument("--batch", type=int, default=32, help="sequences in the batch")
    parser.add_argument("--prompt-len", type=int, default=32, help="longest prompt (shortest: half)")
    parser.add_argument("--median-response", type=int, default=24, help="median of the log-normal")
    parser.add_argument("--sigma", type=float, default=1.3, help="sigma of the log-normal")
    parser.add_argument("--max-response", type=int, default=448, help="response lengths cap")
    parser.add_argument(
        "--micro-batch-size", type=int, default=4, help="padded side: sequences per micro-batch"
    )
    parser.add_argument("--max-tokens", type=int, default=None, help="packed side: token budget (default T)")
    parser.add_argument("--dp", type=int, default=2, help="data-parallel ranks for the balance report")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def skewed_batch(vocab: int, *, batch: int, prompt_len: int, median: int, sigma: float, cap: int, seed: int):
    """[left-padded prompt | right-padded response] with log-normal response lengths."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    resp_len = (median * torch.exp(sigma * torch.randn(batch, generator=gen))).round().clamp(1, cap).long()
    prompt_len_B = torch.randint(max(1, prompt_len // 2), prompt_len + 1, (batch,), generator=gen)
    P, R = int(prompt_len_B.max()), int(resp_len.max())
    prompt_mask = torch.arange(P) >= P - prompt_len_B[:, None]
    resp_mask = torch.arange(R) < resp_len[:, None]
    prompt = torch.randint(1, vocab, (batch, P), generator=gen).masked_fill(~prompt_mask, 0)
    resp = torch.randint(1, vocab, (batch, R), generator=gen).masked_fill(~resp_mask, 0)
    return {
        "input_ids": torch.cat([prompt, resp], 1),
        "attention_mask": torch.cat([prompt_mask, resp_mask], 1).long(),
        "responses": resp,
        "response_mask": resp_mask.long(),
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from rl3d.config import ActorConfig, ModelConfig, OptimConfig
    from rl3d.engine import MegatronEngine
    from rl3d.models.bootstrap import destroy_megatron, init_megatron
    from rl3d.models.logprobs import vocab_parallel_logprobs_entropy
    from rl3d.models.spec import get_model_spec
    from rl3d.parallel.layout import ParallelLayout
    from rl3d.single_controller.batch import DataBatch
    from rl3d.testing.spawn import free_port
    from rl3d.utils.device import init_process_group

    spec = get_model_spec(args.model)
    data = skewed_batch(
        spec.vocab_size,
        batch=args.batch,
        prompt_len=args.prompt_len,
        median=args.median_response,
        sigma=args.sigma,
        cap=args.max_response,
        seed=args.seed,
    )
    T = data["input_ids"].shape[1]
    if T > spec.max_position_embeddings:
        raise ValueError(
            f"sequences of {T} tokens exceed {spec.name}'s {spec.max_position_embeddings} positions"
        )
    lengths = data["response_mask"].sum(1).float()
    skew = float(lengths.max() / lengths.median())
    if skew < MIN_SKEW:
        raise ValueError(f"longest / median response length is {skew:.1f}, below {MIN_SKEW}: raise --sigma")
    if args.threads:
        torch.set_num_threads(args.threads)
    batch = DataBatch(data)
    started = not dist.is_initialized()
    if started:
        # a CPU benchmark: one gloo rank, through the device module like every process group
        init_process_group(
            "cpu", timeout_s=600, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
        )
    try:
        groups = init_megatron(ParallelLayout(1, 1, 1), seed=args.seed)
        # the same network twice, padded and packed (a token budget per micro-batch)
        model = ModelConfig(name=args.model, dtype="float32")
        common = dict(role="actor", model=model, seed=args.seed, optim=OptimConfig())
        padded = MegatronEngine.from_config(spec, groups, **common)
        budget = args.max_tokens or T
        batching = ActorConfig(packing=True, max_tokens_per_micro_batch=budget)
        packed = MegatronEngine.from_config(spec, groups, batching=batching, init_from=padded, **common)

        def logp_of(role, output, micro):
            logits = role.response_slice(output, micro)
            logp, _ = vocab_parallel_logprobs_entropy(
                logits, micro["responses"], groups.tp_group, vocab_size=spec.vocab_size
            )
            return logp * micro["response_mask"]

        def loss_of(role):
            def loss(output, micro):
                mask = micro["response_mask"]
                value = -logp_of(role, output, micro).sum() / mask.sum().clamp(min=1)
                return value, {"loss": value.detach()}

            return loss

        logps = {}
        for name, role in (("padded", padded), ("packed", packed)):
            outs = role.run_forward(
                batch, args.micro_batch_size, lambda o, m, r=role: (torch.zeros(()), {"l": logp_of(r, o, m)})
            )
            logps[name] = torch.cat([o["l"] for o in outs])
        runs = {
            name: (lambda role=role: role.forward_backward(batch, args.micro_batch_size, loss_of(role)))
            for name, role in (("padded", padded), ("packed", packed))
        }
        seconds = _timed(runs, args.repeats)
        destroy_megatron()
    finally:
        if started:
            dist.destroy_process_group()
    padded_s, packed_s = (statistics.median(seconds[k]) for k in ("padded", "packed"))
    real = int(data["attention_mask"].sum())
    return _balance(data["attention_mask"].sum(1).tolist(), args.dp, budget) | {
        "padded_seconds": padded_s,
        "packed_seconds": packed_s,
        "speedup": padded_s / packed_s,
        "padded_tokens": int(data["input_ids"].numel()),
        "packed_tokens": real,
        "max_abs_logp_diff": float((logps["padded"] - logps["packed"]).abs().max()),
        "model": spec.name,
        "batch": args.batch,
        "seq_width": T,
        "longest_over_median_response": skew,
        "micro_batch_size": args.micro_batch_size,
        "max_tokens_per_micro_batch": budget,
    }


def _balance(lengths: list[int], dp: int, budget: int) -> dict[str, float]:
    from rl3d.models.packing import first_fit_decreasing, token_budget_groups
    from rl3d.utils.partition import balanced_partition, imbalance

    share = len(lengths) // dp
    return {
        "dp_imbalance_contiguous": imbalance(
            lengths, [list(range(r * share, (r + 1) * share)) for r in range(dp)]
        ),
        "dp_imbalance_balanced": imbalance(lengths, balanced_partition(lengths, dp)),
        "micro_imbalance_first_fit": imbalance(lengths, first_fit_decreasing(lengths, budget)),
        "micro_imbalance_balanced": imbalance(
            lengths, token_budget_groups(lengths, budget, key="--max-tokens")
        ),
    }


def _timed(fns: dict[str, Any], repeats: int) -> dict[str, list[float]]:
    """One warm-up call each, then `repeats` rounds calling both, alternating the order."""
    for fn in fns.values():
        fn()
    seconds: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(repeats):
        for name in list(fns)[:: 1 if r % 2 == 0 else -1]:
            start = time.perf_counter()
            fns[name]()
            seconds[name].append(time.perf_counter() - start)
    return seconds


CONTRACT = (
    "padded_seconds",
    "packed_seconds",
    "speedup",
    "padded_tokens",
    "packed_tokens",
    "max_abs_logp_diff",
)


def run_packing_bench(args: argparse.Namespace) -> str:
    for key in (
        "batch",
        "prompt_len",
        "median_response",
        "max_response",
        "micro_batch_size",
        "repeats",
        "dp",
    ):
        if getattr(args, key) < 1:
            raise ValueError(f"--{key.replace('_', '-')} must be >= 1, got {getattr(args, key)}")
    if args.batch % args.micro_batch_size:
        raise ValueError(
            f"--batch {args.batch} is not a multiple of --micro-batch-size {args.micro_batch_size}"
        )
    if args.batch % args.dp:
        raise ValueError(f"--batch {args.batch} is not a multiple of --dp {args.dp}")
    result = measure(args)
    if args.json:
        return json.dumps({k: result[k] for k in CONTRACT})
    return "\n".join(
        f"{k:32s} {v:.4g}" if isinstance(v, float) else f"{k:32s} {v}" for k, v in result.items()
    )
