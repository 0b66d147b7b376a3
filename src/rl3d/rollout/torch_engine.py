"""rl3d's own rollout engine: batched prefill + decode over the generation-TP shards.

It computes directly from the pieces the 3D-HybridEngine hands over (see `rl3d.rollout.model`),
so generation holds no second copy of the weights. Prompts are left-padded (RoPE positions
start at 0 at each prompt's first real token); the n samples of a prompt share one prefill
whose KV rows are then copied n times; finished rows are dropped from the batch (`KVCache.compact`),
so decode compute follows the number of unfinished sequences. `stats` counts the rows each
forward really computed.

A decode step is kept to the model's own ops (on CPU, per-op dispatch is most of a small model's
time): RoPE cos/sin are gathered from a table built once per engine, the attention mask is a view
of one additive row per (sample, kv head), each row's uniforms are drawn for all steps up front,
responses are written into device tensors, and the host syncs only to learn which rows hit a stop
token. All of these give bit-identical results to computing each piece per step. The decode
forward itself (`decode_forward`: fused RoPE over the whole qkv output, one batched matmul per
KV group against the cache, one-op RMS statistics) equals the prefill `forward` up to
floating-point reordering; every t_g runs the same code, so t_g > 1 still equals t_g = 1 exactly.

Routing record (`record_routing=True`, mixture-of-experts models): every token's chosen experts
per layer, prompt and response, come back in `RolloutBatch.routing`, so that the trainer can
route its forwards the same way (megatron-core's `RouterReplay` takes, per MoE layer, the
[tokens, top_k] int64 ids of its micro-batch in its token order). A row's last token is run
through the model once more for its routing alone (its logits are not needed), and a row that
stops is dropped from the batch only after that forward.

Tensor parallelism (t_g > 1): every rank of the generation-TP group runs the engine on the same
prompts; row-parallel partial sums and embedding lookups are all-reduced, and the vocab-parallel
logits are all-gathered so that every rank holds the identical full logits. Each rank then
samples with identical seeded generators, so all ranks make the same choices without a
broadcast, and every rank returns the whole batch.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from rl3d.models.spec import ModelSpec
from rl3d.rollout.base import FINISH_LENGTH, FINISH_STOP, RolloutBatch, SamplingParams, check_prompts
from rl3d.rollout.kv_cache import KVCache
from rl3d.rollout.lora_engine import EngineLora
from rl3d.rollout.mla import cache_width
from rl3d.rollout.model import (
    ShardedWeights,
    TPComm,
    additive_mask,
    causal_mask,
    decode_forward,
    embed_tokens,
    forward,
)
from rl3d.rollout.rope import RopeTable
from rl3d.rollout.sampling import draw_uniforms, sample_generators, sample_next, top_logprobs

logger = logging.getLogger(__name__)
FINISH_ABORTED = "aborted"  # stopped early (`EarlyStop`): the row's tokens so far, to be continued


@dataclass
class EarlyStop:
    """End a call once `target` groups of rows have finished (a separate pool's over-sampling,
    `rl3d.workers.oversample`): `groups[r]` is row r's group, `limits[r]` the most tokens row r
    may generate (it finishes with "length" there). Rows unfinished at that point end "aborted"
    with the tokens they have. One sample per prompt (n = 1), one chunk, no routing record."""

    groups: list[int]
    limits: list[int]
    target: int


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
    together (prompts are processed in chunks of max_batch_rows // n). `lora_mode` ("merge" or
    "apply", `rl3d.rollout.lora_engine`) says how adapters given to `load_lora` are used."""

    name = "torch"

    def __init__(
        self,
        spec: ModelSpec,
        weights: Any = None,
        *,
        group: Any = None,
        max_batch_rows: int = 256,
        pad_token_id: int = 0,
        dtype: torch.dtype | None = None,
        record_routing: bool = False,
        lora_mode: str = "merge",
    ):
        if max_batch_rows < 1:
            raise ValueError(f"rollout.max_batch_rows must be >= 1, got {max_batch_rows}")
        if record_routing and not spec.is_moe:
            raise ValueError(f"record_routing: model {spec.name} has no experts (a dense MLP)")
        self.record_routing = record_routing
        self.spec, self.max_batch_rows, self.pad_token_id = spec, max_batch_rows, pad_token_id
        self.dtype = dtype  # None: the weights' own (the training dtype); else a cast copy
        self.tp = TPComm(group)
        self.weights: ShardedWeights | None = None  # what the forward runs: the base, or base + adapters
        self.base_weights: ShardedWeights | None = None
        self.lora = EngineLora(lora_mode)
        self.weight_copy_bytes = 0  # bytes of the cast copy `load_weights` made (0: read in place)
        self.cache: KVCache | None = None
        self._rope_table: RopeTable | None = None
        self.stats = GenerationStats()
        # Partial rollouts (a separate rollout pool, `rl3d.workers.rollout_worker`): called with
        # the step index before each forward that makes a token's logits (0: the prefill); it may
        # `load_weights` new ones, which the rest of the generation then uses.
        self.before_forward: Callable[[int], None] | None = None
        self.early_stop: EarlyStop | None = None  # set around one call by its caller
        if weights is not None:
            self.load_weights(weights)

    # -- RolloutEngine -------------------------------------------------------------------------
    def load_weights(self, weights: Any) -> None:
        """`GenerationWeights` (used in place) or a mapping name -> this rank's Megatron
        generation-TP shard. No tensor is copied, unless the engine runs in another dtype
        (`rollout.dtype`): then it holds a cast copy."""
        if isinstance(weights, Mapping):
            w = ShardedWeights.from_tensors(self.spec, weights, self.tp.size, self.tp.rank)
        elif isinstance(weights, ShardedWeights):  # pieces already split (the LLaVA engine's decoder)
            w = weights.checked()
        else:
            w = ShardedWeights.from_generation(weights)
        self.weight_copy_bytes = 0
        if self.dtype is not None and w.dtype != self.dtype:
            w = w.cast(self.dtype)
            self.weight_copy_bytes = sum(p.nbytes for ps in w.pieces.values() for p in ps)
        if w.tp_size != self.tp.size or w.tp_rank != self.tp.rank:
            raise ValueError(
                f"weights are generation-TP shard {w.tp_rank} of {w.tp_size}, but this rank is "
                f"{self.tp.rank} of {self.tp.size} in the engine's group"
            )
        if w.spec != self.spec:
            raise ValueError(f"weights are for model {w.spec.name}, the engine runs {self.spec.name}")
        self.base_weights = w
        self.weights = self.lora.weights(w)  # adapters loaded earlier apply to the new base
        self.tp.device = w.device
        if self.cache is None or (self.cache.dtype, self.cache.device) != (w.dtype, w.device):
            width = cache_width(self.spec) if self.spec.is_mla else self.spec.head_dim  # MLA: its latent
            self.cache = KVCache(self.spec.num_layers, w.kv_heads(), width,
                                 dtype=w.dtype, device=w.device)  # fmt: skip

    @property
    def lora_copy_bytes(self) -> int:
        """Bytes of the weights its adapters made (merge mode's merged copy; 0 applied)."""
        return self.lora.copy_bytes

    def load_lora(self, tensors: Any, config: Any) -> None:
        """Use these LoRA adapters from now on, over the base weights already loaded.
        `tensors`: PEFT's saved names -> whole (t=1) lora_A / lora_B tensors, which every rank of
        the generation-TP group passes and slices itself; or the `GenerationWeights` the adapter
        transition (`rl3d.hybrid_engine.lora_plan.lora_params`) gave this rank. `config`: a PEFT
        `LoraConfig`, adapter_config.json's dict or `actor.lora` (see `rl3d.rollout.lora`)."""
        if self.base_weights is None:
            raise RuntimeError("torch rollout engine: load_weights() the base before load_lora()")
        self.lora.load(self.spec, tensors, config)
        self.weights = self.lora.weights(self.base_weights)

    def clear_lora(self) -> None:
        """Generate with the base weights alone again."""
        self.lora.clear()
        self.weights = self.base_weights

    def release_memory(self) -> None:
        """Drop the KV cache, the RoPE table and the references to the weights (the trainer owns them)."""
        if self.cache is not None:
            self.cache.release()
        self.lora.release()
        self.weights = self.base_weights = self._rope_table = None

    def resume_memory(self) -> None:
        """Re-allocate the KV cache at its previous size; load weights again before generating."""
        if self.cache is not None:
            self.cache.resume()

    def pause(self) -> None:
        """Drop the KV cache only; the weights stay loaded."""
        if self.cache is not None:
            self.cache.release()

    @torch.inference_mode()
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
        rule = self.early_stop
        if rule is not None and (
            params.n != 1
            or len(prompts) > per_chunk
            or len(rule.groups) != len(prompts)
            or self.record_routing
        ):
            raise ValueError(
                f"early stop: {len(prompts)} prompts (n={params.n}) for {len(rule.groups)} rows must be "
                f"one chunk of at most max_batch_rows={self.max_batch_rows} rows, n 1, no routing record"
            )
        chunks = [
            self._generate_chunk(prompts[lo : lo + per_chunk], params, seed, lo * params.n)
            for lo in range(0, len(prompts), per_chunk)
        ]
        lengths = torch.cat([c.lengths for c in chunks])
        width = int(lengths.max())
        num_rows = len(lengths)
        batch = RolloutBatch(
            response_ids=torch.cat([c.ids[:, :width] for c in chunks]).cpu(),
            lengths=lengths,
            logprobs=torch.cat([c.logprobs[:, :width] for c in chunks]).cpu(),
            finish_reasons=[r for c in chunks for r in c.finish_reasons],
            prompt_index=torch.arange(num_rows, dtype=torch.int64) // params.n,
            raw_logprobs=torch.cat([c.raw_logprobs[:, :width] for c in chunks]).cpu(),
            routing=[r for c in chunks for r in c.routing] if self.record_routing else None,
        )
        if params.top_logprobs:
            batch.top_ids = torch.cat([c.top_ids[:, :width] for c in chunks]).cpu()
            batch.top_logprobs = torch.cat([c.top_logprobs[:, :width] for c in chunks]).cpu()
        batch.metrics.update(self.stats.metrics())
        logger.debug("torch rollout: %d samples, %s", num_rows, self.stats)
        return batch

    def _rope(self, num_positions: int) -> RopeTable:
        """The RoPE table, (re)built only when a batch needs more positions or another dtype."""
        w, rope = self.weights, self._rope_table
        if (
            rope is None
            or rope.num_positions < num_positions
            or (rope.dtype, rope.device) != (w.dtype, w.device)
        ):
            size = min(self.spec.max_position_embeddings, max(num_positions, 256))
            self._rope_table = rope = RopeTable(
                size, self.spec.head_dim, self.spec.rope_theta, w.dtype, w.device, self.spec.rotary_dim
            )
        return rope

    def _prefill_embeds(
        self, tokens: torch.Tensor, first_prompt: int, embed: Callable
    ) -> torch.Tensor | None:
        """The prefill's input embeddings [B, T, hidden] in place of the tokens' (None: the
        tokens'); `first_prompt` is the chunk's first prompt, `embed(tokens)` the decoder's
        lookup. A vision-language engine (`rl3d.rollout.vision`) splices its images here."""
        return None

    def _routes(self, num_rows: int, slots: int) -> torch.Tensor:
        spec = self.spec
        dtype = torch.int16 if spec.num_experts <= torch.iinfo(torch.int16).max else torch.int32
        shape = (num_rows, slots, spec.num_layers, spec.moe_top_k)
        return torch.zeros(shape, dtype=dtype, device=self.weights.device)

    # -- one batch of prompts ------------------------------------------------------------------
    def _generate_chunk(
        self, prompts: list[list[int]], params: SamplingParams, seed: int, first_sample: int
    ) -> _Chunk:
        w, cache, n, device = self.weights, self.cache, params.n, self.weights.device
        num_prompts, width = len(prompts), max(len(p) for p in prompts)
        num_rows, num_new, slots = num_prompts * n, params.max_new_tokens, width + params.max_new_tokens
        cache.reserve(num_rows, slots)
        rope = self._rope(slots)
        lengths = torch.tensor([len(p) for p in prompts], device=device)
        pad = width - lengths
        tokens = torch.full((num_prompts, width), self.pad_token_id, dtype=torch.int64, device=device)
        for i, p in enumerate(prompts):
            tokens[i, width - len(p) :] = torch.tensor(p, dtype=torch.int64, device=device)
        cols = torch.arange(width, device=device)
        key_valid = torch.zeros(num_prompts, slots, dtype=torch.bool, device=device)
        key_valid[:, :width] = cols >= pad[:, None]
        positions = (cols - pad[:, None]).clamp(min=0)
        mask = causal_mask(key_valid, 0, width, w.dtype)
        hook = self.before_forward
        if hook is not None:
            hook(0)
            w = self.weights
        # routing record: [rows, slots, layers, k], slot width + s is response token s
        routes = self._routes(num_rows, slots) if self.record_routing else None
        record = None if routes is None else []
        embeds = self._prefill_embeds(tokens, first_sample // n, lambda t: embed_tokens(w, t, self.tp))
        logits = forward(w, tokens, rope.gather(positions), cache, 0, mask, self.tp, record, embeds)
        if record is not None:
            prefill = torch.stack(record, 1).view(num_prompts, width, *routes.shape[2:])
            routes[:, :width] = prefill.repeat_interleave(n, dim=0)
        self.stats.prefill_rows += num_prompts
        self.stats.prefill_tokens += num_prompts * width
        # n samples per prompt: copy the prefill's KV rows and logits instead of recomputing them.
        cache.expand(num_prompts, n, width)
        logits = logits.repeat_interleave(n, dim=0)
        # decode masks are views of one additive row per (sample, kv head): 0 at real tokens,
        # -inf at padding; [rows, kv_heads, slots]
        key_bias = additive_mask(key_valid.repeat_interleave(n, dim=0), w.dtype)
        key_bias = key_bias[:, None].expand(-1, w.kv_heads(), -1).contiguous()
        # every decode step's RoPE position per row: [rows, max_new_tokens]
        positions = lengths.repeat_interleave(n)[:, None] + torch.arange(num_new, device=device)
        rope_decode = rope.decode_table(self.spec.heads_per_group)
        swap = rope.swap_index(w.kv_heads() * (self.spec.heads_per_group + 2) * self.spec.head_dim)
        generators = sample_generators(seed, range(first_sample, first_sample + num_rows))
        # every row's uniforms for all steps at once: the same numbers as one draw per step
        uniforms = None if params.greedy else draw_uniforms(generators, device, steps=num_new)
        stop_ids = torch.tensor(sorted(params.stop_token_ids), dtype=torch.int64, device=device)
        # Responses are written on the device, one column per step; the host only learns which
        # rows stopped (one small copy per step, none at all without stop tokens).
        out = _Chunk(
            ids=torch.full((num_rows, num_new), self.pad_token_id, dtype=torch.int64, device=device),
            logprobs=torch.zeros(num_rows, num_new, dtype=torch.float32, device=device),
            raw_logprobs=torch.zeros(num_rows, num_new, dtype=torch.float32, device=device),
            lengths=torch.full((num_rows,), num_new, dtype=torch.int64),
            finish_reasons=[FINISH_LENGTH] * num_rows,
        )
        top_k = min(params.top_logprobs, self.spec.vocab_size)
        if top_k:
            out.top_ids = torch.zeros(num_rows, num_new, top_k, dtype=torch.int64, device=device)
            out.top_logprobs = torch.zeros(num_rows, num_new, top_k, dtype=torch.float32, device=device)
        active = list(range(num_rows))  # row of the cache -> sample index within the chunk
        rule = self.early_stop
        if rule is not None:
            limits = torch.tensor(rule.limits, dtype=torch.int64, device=device)
            left = {g: rule.groups.count(g) for g in set(rule.groups)}  # unfinished rows per group
            groups_done = 0
        rows: slice | torch.Tensor = slice(None)  # the same, as an index into `out`'s rows
        for step in range(num_new):
            full_logits = self.tp.all_gather_last(logits)
            u = None if uniforms is None else uniforms[rows, step]
            tok, logp, raw = sample_next(full_logits, params, (), self.spec.vocab_size, u)
            self.stats.generated_tokens += len(active)
            out.ids[rows, step], out.raw_logprobs[rows, step] = tok, raw
            if not params.greedy:  # greedy: logp is 0, as `out.logprobs` already holds
                out.logprobs[rows, step] = logp
            if top_k:  # the alternatives, from the logits the token was sampled from
                out.top_logprobs[rows, step], out.top_ids[rows, step] = top_logprobs(
                    full_logits, self.spec.vocab_size, top_k
                )
            done: list[bool] = []
            if len(stop_ids) or rule is not None:
                stopped = (
                    torch.isin(tok, stop_ids) if len(stop_ids) else torch.zeros_like(tok, dtype=torch.bool)
                )
                hit = stopped.tolist()
                if rule is not None:
                    stopped = stopped | (limits[rows] <= step + 1)
                done = stopped.tolist()
                for r, s in enumerate(active):
                    if done[r]:
                        out.finish_reasons[s] = FINISH_STOP if hit[r] else FINISH_LENGTH
                        out.lengths[s] = step + 1
                        if rule is not None:
                            left[rule.groups[s]] -= 1
                            groups_done += left[rule.groups[s]] == 0
                if rule is not None and groups_done >= rule.target and not all(done):
                    for r, s in enumerate(active):  # enough groups: the others stop where they are
                        if not done[r]:
                            out.finish_reasons[s], out.lengths[s] = FINISH_ABORTED, step + 1
                    done = [True] * len(done)
            last = step + 1 == num_new or (done and all(done))
            # without a routing record, finished rows are dropped before the forward (later steps
            # compute on the survivors only); with one, after it: it routes their last token
            if last and routes is None:
                break
            if any(done) and routes is None:
                keep, active, rows = _drop(cache, stopped, active, width + step)
                key_bias, positions, tok = key_bias[keep], positions[keep], tok[keep]
            slot = width + step
            key_bias[:, :, slot] = 0.0  # the new token sees itself and all real tokens before it
            mask = key_bias[:, :, : slot + 1].flatten(0, 1)[:, None]
            rope_step = rope_decode.index_select(0, positions[:, step])
            if hook is not None and not last:  # a safe point: the next token's logits come from it
                hook(step + 1)
                w = self.weights
            record = None if routes is None else []
            logits = decode_forward(w, tok, rope_step, swap, cache, slot, mask, self.tp, record)
            self.stats.decode_steps += 1
            self.stats.decode_rows += len(active)
            if record is not None:
                routes[rows, slot] = torch.stack(record, 1).to(routes.dtype)
                if last:
                    break
                if any(done):
                    keep, active, rows = _drop(cache, stopped, active, slot + 1)
                    key_bias, positions, logits = key_bias[keep], positions[keep], logits[keep]
        if routes is not None:
            out.routing = [
                routes[r, width - len(prompts[r // n]) : width + int(out.lengths[r])].cpu()
                for r in range(num_rows)
            ]
        return out


def _drop(cache: KVCache, stopped: torch.Tensor, active: list[int], slots: int):
    """Move the unfinished rows to the front of the cache (slots [0, slots)): their indices among
    the current rows, their sample indices, and the same as a tensor."""
    keep = (~stopped).nonzero().squeeze(-1)
    cache.compact(keep, slots)
    active = [s for s, done in zip(active, stopped.tolist()) if not done]
    return keep, active, torch.tensor(active, dtype=torch.int64, device=stopped.device)


@dataclass
class _Chunk:
    """One chunk's responses: [rows, max_new_tokens] on the engine's device, padded past `lengths`."""

    ids: torch.Tensor
    logprobs: torch.Tensor
    raw_logprobs: torch.Tensor
    lengths: torch.Tensor
    finish_reasons: list[str]
    routing: list[torch.Tensor] | None = None  # per row [prompt + response tokens, layers, k]
    top_ids: torch.Tensor | None = None  # [rows, max_new_tokens, k] with SamplingParams.top_logprobs
    top_logprobs: torch.Tensor | None = None
