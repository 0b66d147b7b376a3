"""rl3d's own rollout engine: batched prefill + decode over the generation-TP shards.

It computes directly from the pieces the 3D-HybridEngine hands over (see `rl3d.rollout.model`),
so generation holds no second copy of the weights. Prompts are left-padded (RoPE positions
start at 0 at each prompt's first real token); the n samples of a prompt share one prefill
whose KV rows are then copied n times; finished rows are dropped from the batch (`KVCache.compact`),
so decode compute follows the number of unfinished sequences. `stats` counts the rows each
forward really computed.

Tensor parallelism (t_g > 1): every rank of the generation-TP group runs the engine on the same
prompts; row-parallel partial sums and embedding lookups are all-reduced, and the vocab-parallel
logits are all-gathered so that every rank holds the identical full logits. Each rank then
samples with identical seeded generators, so all ranks make the same choices without a
broadcast, and every rank returns the whole batch.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from rl3d.models.spec import ModelSpec
from rl3d.rollout.base import FINISH_LENGTH, FINISH_STOP, RolloutBatch, SamplingParams, check_prompts
from rl3d.rollout.kv_cache import KVCache
from rl3d.rollout.model import ShardedWeights, TPComm, forward
from rl3d.rollout.sampling import sample_generators, sample_next

logger = logging.getLogger(__name__)


@dataclass
class GenerationStats:
    """Work done by the last `generate` call, counted in rows actually computed."""

    prefill_rows: int = 0
    prefill_tokens: int = 0  # padded prompt tokens run through prefill
    decode_steps: int = 0
    decode_rows: int = 0  # sum over decode forwards of the rows in the batch
    generated_tokens: int = 0

    def metrics(self) -> dict[str, float]:
        return {f"rollout/{k}": float(v) for k, v in asdict(self).items()}


class TorchRolloutEngine:
    """The `torch` RolloutEngine. `group` is the generation-TP group (`rl3d.parallel.groups.Group`
    or a raw process group; None for t_g = 1). `max_batch_rows` bounds the samples decoded
    together (prompts are processed in chunks of max_batch_rows // n)."""

    name = "torch"

    def __init__(
        self,
        spec: ModelSpec,
        weights: Any = None,
        *,
        group: Any = None,
        max_batch_rows: int = 256,
        pad_token_id: int = 0,
    ):
        if max_batch_rows < 1:
            raise ValueError(f"rollout.max_batch_rows must be >= 1, got {max_batch_rows}")
        self.spec, self.max_batch_rows, self.pad_token_id = spec, max_batch_rows, pad_token_id
        self.tp = TPComm(group)
        self.weights: ShardedWeights | None = None
        self.cache: KVCache | None = None
        self.stats = GenerationStats()
        if weights is not None:
            self.load_weights(weights)

    # -- RolloutEngine -------------------------------------------------------------------------
    def load_weights(self, weights: Any) -> None:
        """`GenerationWeights` (used in place) or a mapping name -> this rank's Megatron
        generation-TP shard. No tensor is copied."""
        if isinstance(weights, Mapping):
            w = ShardedWeights.from_tensors(self.spec, weights, self.tp.size, self.tp.rank)
        else:
            w = ShardedWeights.from_generation(weights)
        if w.tp_size != self.tp.size or w.tp_rank != self.tp.rank:
            raise ValueError(
                f"weights are generation-TP shard {w.tp_rank} of {w.tp_size}, but this rank is "
                f"{self.tp.rank} of {self.tp.size} in the engine's group"
            )
        if w.spec != self.spec:
            raise ValueError(f"weights are for model {w.spec.name}, the engine runs {self.spec.name}")
        self.weights = w
        self.tp.device = w.device
        if self.cache is None or (self.cache.dtype, self.cache.device) != (w.dtype, w.device):
            self.cache = KVCache(self.spec.num_layers, w.kv_heads(), self.spec.head_dim,
                                 dtype=w.dtype, device=w.device)  # fmt: skip

    def release_memory(self) -> None:
        """Drop the KV cache and the references to the weights (the trainer owns them)."""
        if self.cache is not None:
            self.cache.release()
        self.weights = None

    def resume_memory(self) -> None:
        """Re-allocate the KV cache at its previous size; load weights again before generating."""
        if self.cache is not None:
            self.cache.resume()

    @torch.no_grad()
    def generate(self, prompts_token_ids: Sequence[Sequence[int]], params: SamplingParams) -> RolloutBatch:
        if self.weights is None:
            raise RuntimeError("torch rollout engine has no weights: call load_weights() first")
        prompts = check_prompts(prompts_token_ids, self.spec.vocab_size)
        digest = zlib.crc32(repr((prompts, params)).encode())
        if not self.tp.agree(digest):
            raise ValueError(
                f"generate: the ranks of the generation-TP group {self.tp.ranks} passed different prompts "
                "or sampling params; every rank of the group must pass the same ones"
            )
        longest = max(len(p) for p in prompts) + params.max_new_tokens
        if longest > self.spec.max_position_embeddings:
            raise ValueError(
                f"SamplingParams.max_new_tokens={params.max_new_tokens}: prompt + response reach {longest} "
                f"tokens, beyond the model's max_position_embeddings={self.spec.max_position_embeddings}"
            )
        seed = params.seed
        if seed is None:
            seed = int(torch.randint(0, 2**62, ()).item()) if self.tp.rank == 0 else 0
            seed = self.tp.broadcast_int(seed)
        self.stats = GenerationStats()
        per_chunk = max(1, self.max_batch_rows // params.n)
        rows: list[tuple[list[int], list[float], list[float], str]] = []
        for lo in range(0, len(prompts), per_chunk):
            rows += self._generate_chunk(prompts[lo : lo + per_chunk], params, seed, lo * params.n)
        batch = RolloutBatch.from_lists(
            [r[0] for r in rows], [r[1] for r in rows], [r[3] for r in rows],
            [i // params.n for i in range(len(rows))], raw_logprobs=[r[2] for r in rows],
            pad_token_id=self.pad_token_id,
        )  # fmt: skip
        batch.metrics.update(self.stats.metrics())
        logger.debug("torch rollout: %d samples, %s", len(rows), self.stats)
        return batch

    # -- one batch of prompts ------------------------------------------------------------------
    def _generate_chunk(self, prompts: list[list[int]], params: SamplingParams, seed: int, first_sample: int):
        w, cache, n, device = self.weights, self.cache, params.n, self.weights.device
        num_prompts, width = len(prompts), max(len(p) for p in prompts)
        num_rows, slots = num_prompts * n, width + params.max_new_tokens
        cache.reserve(num_rows, slots)
        lengths = torch.tensor([len(p) for p in prompts], device=device)
        pad = width - lengths
        tokens = torch.full((num_prompts, width), self.pad_token_id, dtype=torch.int64, device=device)
        for i, p in enumerate(prompts):
            tokens[i, width - len(p) :] = torch.tensor(p, dtype=torch.int64, device=device)
        cols = torch.arange(width, device=device)
        key_valid = torch.zeros(num_prompts, slots, dtype=torch.bool, device=device)
        key_valid[:, :width] = cols >= pad[:, None]
        positions = (cols - pad[:, None]).clamp(min=0)
        logits = forward(w, tokens, positions, cache, 0, key_valid, self.tp)
        self.stats.prefill_rows += num_prompts
        self.stats.prefill_tokens += num_prompts * width
        # n samples per prompt: copy the prefill's KV rows and logits instead of recomputing them.
        cache.expand(num_prompts, n, width)
        logits = logits.repeat_interleave(n, dim=0)
        key_valid = key_valid.repeat_interleave(n, dim=0)
        next_pos = lengths.repeat_interleave(n)
        generators = sample_generators(seed, range(first_sample, first_sample + num_rows))
        stop_ids = torch.tensor(sorted(params.stop_token_ids), dtype=torch.int64, device=device)
        active = list(range(num_rows))  # row of the cache -> sample index within the chunk
        out = [([], [], [], FINISH_LENGTH) for _ in range(num_rows)]
        for step in range(params.max_new_tokens):
            full_logits = self.tp.all_gather_last(logits)
            tok, logp, raw = sample_next(full_logits, params, generators, self.spec.vocab_size)
            self.stats.generated_tokens += len(active)
            stopped = torch.isin(tok, stop_ids)
            # one device -> host copy per step (token ids are exact in float64)
            host = torch.stack([tok.double(), logp.double(), raw.double(), stopped.double()]).cpu().tolist()
            done = [bool(d) for d in host[3]]
            for r, s in enumerate(active):
                out[s][0].append(int(host[0][r]))
                out[s][1].append(host[1][r])
                out[s][2].append(host[2][r])
                if done[r]:
                    out[s] = (*out[s][:3], FINISH_STOP)
            if step + 1 == params.max_new_tokens or all(done):
                break
            if any(done):  # drop finished rows: later steps compute on the survivors only
                keep = (~stopped).nonzero().squeeze(-1)
                cache.compact(keep, width + step)
                key_valid, next_pos, tok = key_valid[keep], next_pos[keep], tok[keep]
                active = [s for r, s in enumerate(active) if not done[r]]
                generators = [g for r, g in enumerate(generators) if not done[r]]
            slot = width + step
            key_valid[:, slot] = True
            logits = forward(w, tok[:, None], (next_pos + step)[:, None], cache, slot, key_valid, self.tp)
            self.stats.decode_steps += 1
            self.stats.decode_rows += len(active)
        return out
