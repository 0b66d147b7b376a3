"""The trainer's log-probs of a LLaVA policy's responses: megatron-core's `LLaVAModel` over each
row's prompt (one image token per image, as a loaded prompt holds them) and response.

The rows come in the trainer's padded layout (`rl3d.workers.generation.rows_to_batch`: prompts
left-padded to P columns, responses right-padded to R), with each row's pixels. megatron's LLaVA
widens each image token to `num_image_tokens` positions, so a row's response starts
`images * (num_image_tokens - 1)` positions later in the logits than in its ids; left padding
would shift it again and be attended to, so each row runs without it:

- a row's ids are its real prompt tokens, then all R response columns (right padding after the
  response only reaches positions past it: attention is causal);
- rows with the same number of images run in one forward (they widen alike; megatron places
  each row's images where its image tokens are), right-padded to the longest;
- response column r of a row whose widened prompt has w positions is predicted by position
  w - 1 + r.

Log-probs and entropies come from `vocab_parallel_logprobs_entropy` (the text path's), so the
gradient reaches the decoder, the projector and (unless frozen) the tower.
"""

from __future__ import annotations

from typing import Any

import torch

from rl3d.models.llava import LlavaSpec, no_images
from rl3d.models.logprobs import vocab_parallel_logprobs_entropy


def llava_response_logprobs(
    model: Any,
    spec: LlavaSpec,
    input_ids_BT: torch.Tensor,
    attention_mask_BT: torch.Tensor,
    responses_BR: torch.Tensor,
    pixels: list[torch.Tensor | None],
    *,
    tp_group: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp_BR, entropy_BR) in fp32 of each row's response tokens under `model` (megatron-core's
    `LLaVAModel`, this TP rank's shard; `tp_group` its TP group, None for the whole vocabulary).

    `input_ids_BT` = [prompt (left-padded, P columns) | response (right-padded, R columns)],
    `attention_mask_BT` marks the real tokens, `pixels[i]` is row i's `[n_i, 3, size, size]`
    (None or empty: text only; `n_i` must count the row's image tokens). Positions past a row's
    response hold finite values the caller masks out (`response_mask`), as in the text path.
    """
    B, T = input_ids_BT.shape
    R = responses_BR.shape[1]
    if len(pixels) != B:
        raise ValueError(f"{B} rows but {len(pixels)} pixel entries")
    prompts, counts = _prompts(input_ids_BT[:, : T - R], attention_mask_BT[:, : T - R], spec, pixels)
    _refuse_image_tokens_in_responses(responses_BR, attention_mask_BT[:, T - R :], spec)
    parts_logp, parts_entropy, order = [], [], []
    for k in sorted(set(counts)):
        rows = [i for i, c in enumerate(counts) if c == k]
        logits_bRV = _group_logits(
            model, spec, [prompts[i] for i in rows], responses_BR[rows], k, pixels, rows
        )
        logp, entropy = vocab_parallel_logprobs_entropy(
            logits_bRV, responses_BR[rows], tp_group, vocab_size=spec.text.vocab_size
        )
        parts_logp.append(logp)
        parts_entropy.append(entropy)
        order.extend(rows)
    # back to the batch's row order, keeping the graph
    inverse = torch.empty(B, dtype=torch.long)
    inverse[torch.tensor(order)] = torch.arange(B)
    inverse = inverse.to(responses_BR.device)
    return torch.cat(parts_logp)[inverse], torch.cat(parts_entropy)[inverse]


def _prompts(
    prompt_BP: torch.Tensor, mask_BP: torch.Tensor, spec: LlavaSpec, pixels: list[torch.Tensor | None]
) -> tuple[list[torch.Tensor], list[int]]:
    """Each row's real prompt tokens and its number of images, checked against its pixels."""
    prompts, counts = [], []
    for i, (ids, mask, px) in enumerate(zip(prompt_BP, mask_BP, pixels, strict=True)):
        real = ids[mask.bool()]
        k = int((real == spec.image_token_id).sum())
        got = 0 if px is None else int(px.shape[0])
        if k != got:
            raise ValueError(
                f"row {i}: its prompt holds {k} image token(s) (id {spec.image_token_id}) "
                f"but its pixels have {got} image(s)"
            )
        size = spec.image_size
        if got and tuple(px.shape[1:]) != (3, size, size):
            raise ValueError(f"row {i}: pixels of shape {tuple(px.shape)}, expected [n, 3, {size}, {size}]")
        prompts.append(real)
        counts.append(k)
    return prompts, counts


def _refuse_image_tokens_in_responses(
    responses_BR: torch.Tensor, mask_BR: torch.Tensor, spec: LlavaSpec
) -> None:
    """megatron's LLaVA reads every image token as an image: a generated one would misalign the
    row (and ask for pixels it has none of)."""
    hits = ((responses_BR == spec.image_token_id) & mask_BR.bool()).nonzero()
    if len(hits):
        row, col = hits[0].tolist()
        raise ValueError(
            f"row {row}: response token {col} is the image token (id {spec.image_token_id}); "
            "a LLaVA response must be text"
        )


def _group_logits(
    model: Any,
    spec: LlavaSpec,
    prompts: list[torch.Tensor],
    responses_bR: torch.Tensor,
    k: int,
    pixels: list[torch.Tensor | None],
    rows: list[int],
) -> torch.Tensor:
    """[b, R, V_local]: the logits predicting the response columns of rows with k images each."""
    R = responses_bR.shape[1]
    lengths = [len(p) + R for p in prompts]
    L = max(lengths)
    ids = responses_bR.new_zeros(len(prompts), L)  # right padding: past every real position
    for j, prompt in enumerate(prompts):
        ids[j, : len(prompt)] = prompt
        ids[j, len(prompt) : len(prompt) + R] = responses_bR[j]
    images = torch.cat([pixels[i] for i in rows]) if k else no_images(spec)
    device = ids.device
    position_ids = torch.arange(L, device=device)[None].expand(len(prompts), L)
    logits, _ = model(images.to(device), ids, position_ids, None)
    widen = k * (spec.num_image_tokens - 1)
    starts = [len(p) + widen - 1 for p in prompts]
    return torch.stack([logits[j, s : s + R] for j, s in enumerate(starts)])
