"""The rollout-engine contract: sampling parameters in, a batch of responses with log-probs out.

Every engine (`torch`, `sglang`) implements `RolloutEngine`. Prompts are token ids; responses
come back right-padded in one `RolloutBatch`, samples ordered prompt-major: the n samples of
prompt 0, then those of prompt 1, ... (`prompt_index` says which prompt each row came from).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

FINISH_STOP = "stop"  # a stop token was sampled (it is kept as the last response token)
FINISH_LENGTH = "length"  # max_new_tokens reached
FINISH_REASONS = (FINISH_STOP, FINISH_LENGTH)


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to sample. `temperature=0` is greedy; `top_k=0` (or -1) and `top_p=1` disable those
    filters. `seed=None` draws a fresh seed (shared by all TP ranks); a fixed seed makes the
    output reproducible. `n` samples are drawn per prompt. `top_logprobs=k > 0` also returns, for
    each generated token, the k most likely tokens under the plain softmax and their log-probs
    (engines that can: `RolloutBatch.top_ids`)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    n: int = 1
    seed: int | None = None
    top_logprobs: int = 0

    def __post_init__(self) -> None:
        def bad(key: str, what: str) -> ValueError:
            return ValueError(f"SamplingParams.{key}: {what}, got {getattr(self, key)!r}")

        def is_int(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise bad("temperature", "must be a finite number >= 0 (0 = greedy)")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 < p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if not is_int(self.top_k) or self.top_k < -1:
            raise bad("top_k", "must be an integer >= 0 (0 or -1 = disabled)")
        if not is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise bad("max_new_tokens", "must be an integer >= 1")
        if not is_int(self.n) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        if not is_int(self.top_logprobs) or self.top_logprobs < 0:
            raise bad("top_logprobs", "must be an integer >= 0 (0 = none)")
        if self.seed is not None and (not is_int(self.seed) or self.seed < 0):
            raise bad("seed", "must be None or an integer >= 0")
        stops = self.stop_token_ids
        if isinstance(stops, (str, bytes)) or not isinstance(stops, Sequence):
            raise bad("stop_token_ids", "must be a sequence of token ids")
        if any(not is_int(s) or s < 0 for s in stops):
            raise bad("stop_token_ids", "must hold integers >= 0")
        object.__setattr__(self, "stop_token_ids", tuple(stops))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class RolloutBatch:
    """Responses of one `generate` call, N = num_prompts * n rows, right-padded to L tokens.

    - `response_ids` [N, L] int64 (`pad_token_id` past each length), `lengths` [N] int64;
    - `logprobs` [N, L] float32: log-prob of each sampled token under the distribution it was
      sampled from (temperature-scaled, top-k/top-p filtered, renormalised; 0.0 for greedy);
    - `raw_logprobs` [N, L] float32 or None: the same tokens under the model's plain softmax
      (temperature 1, no filter): PPO's "old log-prob" when sampling used other settings;
    - `finish_reasons`: "stop" or "length" per row; `prompt_index` [N] int64;
    - `routing`: None, or (a mixture of experts, an engine recording routing) per row the experts
      each token of prompt + response was routed to, [prompt + response tokens, layers, top_k]
      (int16; int32 past 32767 experts), each token's ids in descending router probability.
    - `top_ids` [N, L, k] int64 and `top_logprobs` [N, L, k] float32, or None: with
      `SamplingParams.top_logprobs = k`, each step's k most likely tokens under the plain
      softmax, most likely first, from the logits the token was sampled from.
    Padded positions of the log-prob tensors are 0.
    """

    response_ids: torch.Tensor
    lengths: torch.Tensor
    logprobs: torch.Tensor
    finish_reasons: list[str]
    prompt_index: torch.Tensor
    raw_logprobs: torch.Tensor | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    routing: list[torch.Tensor] | None = None
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None

    def __post_init__(self) -> None:
        n = self.response_ids.shape[0]
        assert self.lengths.shape == (n,) and self.prompt_index.shape == (n,), "row counts differ"
        assert self.logprobs.shape == self.response_ids.shape, "logprobs shape != response_ids shape"
        assert len(self.finish_reasons) == n, "one finish reason per row"
        assert self.routing is None or len(self.routing) == n, "one routing record per row"

    def __len__(self) -> int:
        return self.response_ids.shape[0]

    def mask(self) -> torch.Tensor:
        """[N, L] bool: True at real response tokens."""
        steps = torch.arange(self.response_ids.shape[1], device=self.lengths.device)
        return steps.unsqueeze(0) < self.lengths.unsqueeze(1)

    def responses(self) -> list[list[int]]:
        return [row[:n].tolist() for row, n in zip(self.response_ids, self.lengths.tolist())]

    def token_logprobs(self, raw: bool = False) -> list[list[float]]:
        src = self.raw_logprobs if raw else self.logprobs
        if src is None:
            raise ValueError("this batch carries no raw log-probs")
        return [row[:n].tolist() for row, n in zip(src, self.lengths.tolist())]

    def token_top(self) -> list[list[list[tuple[int, float]]]] | None:
        """Per row, per generated token, its (token id, raw log-prob) alternatives, most likely
        first; None without `top_ids`."""
        if self.top_ids is None or self.top_logprobs is None:
            return None
        return [
            [list(zip(ids.tolist(), lps.tolist())) for ids, lps in zip(row_ids[:n], row_lps[:n])]
            for row_ids, row_lps, n in zip(self.top_ids, self.top_logprobs, self.lengths.tolist())
        ]

    @classmethod
    def from_lists(
        cls,
        responses: Sequence[Sequence[int]],
        logprobs: Sequence[Sequence[float]],
        finish_reasons: Sequence[str],
        prompt_index: Sequence[int],
        *,
        raw_logprobs: Sequence[Sequence[float]] | None = None,
        pad_token_id: int = 0,
    ) -> RolloutBatch:
        n = len(responses)
        width = max((len(r) for r in responses), default=0)
        ids = torch.full((n, width), pad_token_id, dtype=torch.int64)
        lp = torch.zeros(n, width, dtype=torch.float32)
        raw = torch.zeros(n, width, dtype=torch.float32) if raw_logprobs is not None else None
        for i, r in enumerate(responses):
            if len(logprobs[i]) != len(r):
                raise ValueError(f"row {i}: {len(r)} tokens but {len(logprobs[i])} log-probs")
            ids[i, : len(r)] = torch.as_tensor(list(r), dtype=torch.int64)
            lp[i, : len(r)] = torch.as_tensor(list(logprobs[i]), dtype=torch.float32)
            if raw is not None:
                raw[i, : len(r)] = torch.as_tensor(list(raw_logprobs[i]), dtype=torch.float32)
        bad = sorted(set(finish_reasons) - set(FINISH_REASONS))
        if bad:
            raise ValueError(f"unknown finish reasons {bad}; known: {FINISH_REASONS}")
        return cls(
            response_ids=ids,
            lengths=torch.tensor([len(r) for r in responses], dtype=torch.int64),
            logprobs=lp,
            finish_reasons=list(finish_reasons),
            prompt_index=torch.as_tensor(list(prompt_index), dtype=torch.int64),
            raw_logprobs=raw,
        )


@runtime_checkable
class RolloutEngine(Protocol):
    """What the rollout worker drives. Around a training step the worker calls
    `release_memory()` (before training) and `load_weights(new)` + `resume_memory()` (after)."""

    name: str

    def generate(self, prompts_token_ids: Sequence[Sequence[int]], params: SamplingParams) -> RolloutBatch:
        """Sample `params.n` responses per prompt; every rank of the engine's TP group gets the batch."""
        ...

    def load_weights(self, weights: Any) -> Any:
        """Point the engine at new weights (the 3D-HybridEngine's `GenerationWeights`). An engine
        that reads them in place returns None; one that keeps its own copy pushes the buckets its
        transition planned and returns what it pushed (`sglang_weights.Pushed`)."""
        ...

    def release_memory(self) -> None:
        """Free the engine's KV cache (and weights it owns) so training can use the memory."""
        ...

    def resume_memory(self) -> None:
        """Re-allocate what `release_memory` freed."""
        ...


def check_prompts(prompts_token_ids: Sequence[Sequence[int]], vocab_size: int) -> list[list[int]]:
    """Prompts as lists of ints; ValueError on an empty batch, an empty prompt or an id outside
    the vocabulary."""
    if isinstance(prompts_token_ids, torch.Tensor):
        prompts_token_ids = prompts_token_ids.tolist()
    prompts = [list(map(int, p)) for p in prompts_token_ids]
    if not prompts:
        raise ValueError("generate: no prompts")
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"generate: prompt {i} is empty")
        lo, hi = min(p), max(p)
        if lo < 0 or hi >= vocab_size:
            raise ValueError(
                f"generate: prompt {i} has token id {lo if lo < 0 else hi} outside [0, {vocab_size})"
            )
    return prompts
