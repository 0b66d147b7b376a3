"""Reading SGLang's generate outputs: each request's token ids, log-probs, finish reason and
top-k alternatives, checked against each other."""

from __future__ import annotations

from typing import Any

import torch

from rl3d.rollout.base import FINISH_LENGTH, FINISH_STOP


def top_tensors(tops: list[list[list[tuple[int, float]]]], k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, per token, its (id, log-prob) alternatives as `RolloutBatch.top_ids` and
    `top_logprobs` [rows, longest, k] (zeros past each row's tokens)."""
    width = max((len(t) for t in tops), default=0)
    ids = torch.zeros(len(tops), width, k, dtype=torch.int64)
    lps = torch.zeros(len(tops), width, k, dtype=torch.float32)
    for r, row in enumerate(tops):
        for s, alts in enumerate(row):
            ids[r, s, : len(alts)] = torch.tensor([a for a, _ in alts], dtype=torch.int64)
            lps[r, s, : len(alts)] = torch.tensor([lp for _, lp in alts], dtype=torch.float32)
    return ids, lps


def parse_output(
    output: dict[str, Any], top_logprobs: int = 0
) -> tuple[list[int], list[float], str, list[list[tuple[int, float]]]]:
    """(token ids, log-probs, finish reason, each token's `top_logprobs` alternatives as
    (id, log-prob), most likely first) of one SGLang generate output."""
    meta = output["meta_info"]
    reason = (meta.get("finish_reason") or {}).get("type")
    if reason not in (FINISH_STOP, FINISH_LENGTH):
        raise RuntimeError(f"SGLang request ended with finish_reason={meta.get('finish_reason')!r}")
    ids = list(output["output_ids"])
    entries = meta["output_token_logprobs"]  # (log-prob, token id, text) per output token
    if [int(e[1]) for e in entries] != ids:
        raise RuntimeError(f"SGLang's log-probs are for tokens {[e[1] for e in entries]}, not {ids}")
    logprobs = [float(e[0]) for e in entries]
    top: list[list[tuple[int, float]]] = []
    if top_logprobs:  # (log-prob, token id, text) per alternative, per output token
        top = [[(int(e[1]), float(e[0])) for e in (step or ())] for step in meta["output_top_logprobs"]]
        if len(top) != len(ids):
            raise RuntimeError(f"SGLang returned top log-probs for {len(top)} of {len(ids)} tokens")
    return ids, logprobs, reason, top
