"""The trainer's side of a LLaVA policy (`rl3d.models.llava_logprobs`): log-probs of the rollout
engine's responses recomputed by megatron-core's LLaVAModel from the trainer's padded batch
(`rows_to_batch`'s layout: prompts left-padded, responses right-padded, one image token per image)
equal the engine's; a GRPO step through that path trains the decoder and the projector and leaves
a frozen tower as it was. A tiny random LLaVA, fp32, CPU."""

import pytest
import torch

from rl3d.algos.advantages import grpo_advantages
from rl3d.algos.policy_loss import ppo_policy_loss
from rl3d.models.llava import build_llava, load_llava_weights, read_llava_config
from rl3d.models.llava_logprobs import llava_response_logprobs
from rl3d.rollout import SamplingParams
from rl3d.rollout.vision import LlavaRolloutEngine
from rl3d.single_controller.batch import DataBatch
from rl3d.testing.tiny_hf import make_tiny_llava
from rl3d.workers.generation import rows_to_batch

IMAGE = 250
N = 3  # samples a prompt
# prompts with 1, 2, 0 and 1 images, of different lengths (left-padded differently)
PROMPTS = [[1, 7, IMAGE, 11, 12], [1, IMAGE, 9, 40, IMAGE, 13, 14, 15, 3], [5, 6, 7], [IMAGE, 21]]
TRUNCATE = [12, 5, 9]  # response lengths of a prompt's samples: right padding of several widths


@pytest.fixture(scope="module")
def llava(tmp_path_factory, groups_1x1):
    hf = make_tiny_llava(seed=5, image_token_id=IMAGE)
    directory = tmp_path_factory.mktemp("llava")
    hf.save_pretrained(str(directory))
    spec = read_llava_config(directory)
    model = build_llava(spec, groups_1x1)
    load_llava_weights(model, spec, directory, groups_1x1)
    gen = torch.Generator().manual_seed(3)
    images = [torch.randn(k, 3, 16, 16, generator=gen) if k else None for k in (1, 2, 0, 1)]
    return spec, model, images


def _rollout(spec, model, images):
    """The engine's sampled responses (n=N, temperature 1) as the trainer's batch; each prompt's
    samples cut to TRUNCATE's lengths (a token's log-prob does not depend on later tokens)."""
    engine = LlavaRolloutEngine(spec, {n: p.detach() for n, p in model.named_parameters()})
    out = engine.generate(PROMPTS, SamplingParams(max_new_tokens=12, n=N, seed=11), images=images)
    rows = []
    for row, (response, logps) in enumerate(zip(out.responses(), out.token_logprobs())):
        keep = TRUNCATE[row % N]
        rows.append((row // N, response[:keep], logps[:keep], "length"))
    prompts = DataBatch({"uid": torch.arange(len(PROMPTS))}, {"prompt_ids": PROMPTS})
    batch = rows_to_batch(prompts, rows, pad_token_id=0)
    pixels = [images[row // N] for row in range(len(rows))]
    return batch, pixels


def _logprobs(spec, model, batch, pixels):
    return llava_response_logprobs(
        model, spec, batch["input_ids"], batch["attention_mask"], batch["responses"], pixels
    )


def test_trainer_logprobs_equal_the_engines(llava):
    """Rows of 0, 1 and 2 images, prompts of 3 to 9 tokens left-padded to 9, responses of 5 to 12
    tokens right-padded to 12: every response token's log-prob equals the engine's."""
    spec, model, images = llava
    model.eval()
    batch, pixels = _rollout(spec, model, images)
    assert batch["input_ids"].shape == (len(PROMPTS) * N, 9 + 12)
    with torch.no_grad():
        logp, entropy = _logprobs(spec, model, batch, pixels)
    mask = batch["response_mask"].bool()
    assert int(mask.sum()) == len(PROMPTS) * sum(TRUNCATE)
    worst = (logp - batch["rollout_logp"])[mask].abs().max().item()
    assert worst < 1e-5, worst  # measured 9.5e-7 (fp32)
    assert torch.isfinite(logp).all() and torch.isfinite(entropy).all()
    assert (entropy[mask] > 0).all()
    # the pixels matter: other images, other log-probs (rows with images only)
    other = [None if p is None else p.flip(0) + 1.0 for p in pixels]
    with torch.no_grad():
        moved, _ = _logprobs(spec, model, batch, other)
    has_image = torch.tensor([p is not None for p in pixels])
    assert (moved - logp)[has_image[:, None] & mask].abs().max() > 1e-3
    assert (moved - logp)[~has_image[:, None] & mask].abs().max() == 0


def test_refusals_name_the_row(llava):
    spec, model, images = llava
    batch, pixels = _rollout(spec, model, images)
    ids, attn, resp = batch["input_ids"], batch["attention_mask"], batch["responses"]
    with pytest.raises(
        ValueError, match=r"row 3: its prompt holds 2 image token\(s\) \(id 250\) but its pixels have 1"
    ):
        llava_response_logprobs(model, spec, ids, attn, resp, pixels[:3] + [pixels[3][:1]] + pixels[4:])
    with pytest.raises(ValueError, match="12 rows but 11 pixel entries"):
        llava_response_logprobs(model, spec, ids, attn, resp, pixels[:-1])
    small = [None if p is None else p[:, :, :8, :8] for p in pixels]
    with pytest.raises(ValueError, match=r"row 0: pixels of shape \(1, 3, 8, 8\), expected \[n, 3, 16, 16\]"):
        llava_response_logprobs(model, spec, ids, attn, resp, small)
    bad = resp.clone()
    bad[4, 2] = IMAGE
    with pytest.raises(ValueError, match="row 4: response token 2 is the image token"):
        llava_response_logprobs(model, spec, ids, attn, bad, pixels)


def test_grpo_step_trains_decoder_and_projector_not_the_frozen_tower(llava):
    """One GRPO step (group-normalised rewards, PPO clipped loss, token-mean) through the image
    path with the tower frozen (`LLaVAModel.freeze`): the loss is finite, the decoder and the
    projector get gradients and move, the tower gets none and stays; the trained policy's
    log-probs of the high-reward responses rise."""
    spec, model, images = llava
    batch, pixels = _rollout(spec, model, images)
    model.train()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.freeze(freeze_language_model=False, freeze_vision_model=True, freeze_vision_projection=False)
    try:
        mask = batch["response_mask"]
        # reward: 1 for the first sample of each prompt, 0 for the others
        rewards = torch.zeros_like(mask, dtype=torch.float32)
        last = mask.sum(-1) - 1
        first = torch.arange(len(mask)) % N == 0
        rewards[first, last[first]] = 1.0
        adv = grpo_advantages(rewards_BT=rewards, mask_BT=mask, group_ids_B=batch["uid"]).adv_BT
        logp, entropy = _logprobs(spec, model, batch, pixels)
        loss, _ = ppo_policy_loss(
            logp_BT=logp, old_logp_BT=batch["rollout_logp"], adv_BT=adv, mask_BT=mask, entropy_BT=entropy
        )
        assert torch.isfinite(loss)
        params = dict(model.named_parameters())
        for p in params.values():
            p.grad = None
        loss.backward()
        tower = [n for n in params if n.startswith("vision_model.")]
        projector = [n for n in params if n.startswith("vision_projection.")]
        decoder = [n for n in params if n.startswith("language_model.")]
        assert tower and projector and decoder
        assert all(params[n].grad is None for n in tower)
        for names in (projector, decoder):
            grads = [params[n].grad for n in names if params[n].grad is not None]
            assert grads and all(torch.isfinite(g).all() for g in grads)
            assert max(g.abs().max().item() for g in grads) > 0
        torch.optim.SGD([p for p in params.values() if p.requires_grad], lr=0.5).step()
        moved = {n for n, p in params.items() if not torch.equal(p.detach(), before[n])}
        assert moved & set(projector) and moved & set(decoder)
        assert not moved & set(tower)
        with torch.no_grad():
            after, _ = _logprobs(spec, model, batch, pixels)
        seq = lambda x: (x * mask).sum(-1)  # noqa: E731
        gain = seq(after) - seq(logp.detach())
        assert gain[first].mean() > gain[~first].mean()
    finally:
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(before[n])
                p.requires_grad_(True)
        model.eval()
