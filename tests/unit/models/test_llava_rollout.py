"""The torch rollout engine on LLaVA (`rl3d.rollout.vision.LlavaRolloutEngine`): a tiny random
transformers LlavaForConditionalGeneration (fp32) saved and loaded into megatron-core's LLaVAModel;
the engine runs on that model's parameters (its names and tensors, as the trainer holds them).
Greedy output equals transformers' `generate` token for token; the log-probs of sampled tokens
equal megatron-core's LLaVA forward over prompt + response; n samples share one encoding."""

import pytest
import torch

from rl3d.models.llava import build_llava, hf_input_ids, load_llava_weights, read_llava_config
from rl3d.rollout import SamplingParams
from rl3d.rollout.vision import LlavaRolloutEngine, encode_images
from rl3d.testing.tiny_hf import make_tiny_llava

IMAGE = 250
NEW_TOKENS = 12
# one image token per image (a loaded PromptItem's form); lengths differ, so rows are left-padded
PROMPTS = [[1, 7, IMAGE, 11, 12], [1, IMAGE, 9, 40, IMAGE, 13, 14, 15, 3], [5, 6, 7]]


@pytest.fixture(scope="module")
def llava(tmp_path_factory, groups_1x1):
    hf = make_tiny_llava(seed=5, image_token_id=IMAGE)
    directory = tmp_path_factory.mktemp("llava")
    hf.save_pretrained(str(directory))
    spec = read_llava_config(directory)
    model = build_llava(spec, groups_1x1)
    load_llava_weights(model, spec, directory, groups_1x1)
    model.eval()
    gen = torch.Generator().manual_seed(3)
    images = [torch.randn(k, 3, 16, 16, generator=gen) if k else None for k in (1, 2, 0)]
    return hf, spec, model, images


def _engine(spec, model, **kwargs):
    return LlavaRolloutEngine(spec, {n: p.detach() for n, p in model.named_parameters()}, **kwargs)


def _hf_greedy(hf, spec, prompt, pixels):
    ids = torch.tensor([hf_input_ids(prompt, spec)])
    image_kwargs = {} if pixels is None else {"pixel_values": pixels}
    with torch.no_grad():
        out = hf.generate(
            input_ids=ids,
            **image_kwargs,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            eos_token_id=None,
            pad_token_id=0,
            use_cache=True,
        )
    return out[0, ids.shape[1] :].tolist()


def test_greedy_equals_hf_generate(llava):
    hf, spec, model, images = llava
    batch = _engine(spec, model).generate(
        PROMPTS, SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0), images=images
    )
    assert batch.finish_reasons == ["length"] * len(PROMPTS)
    for prompt, pixels, ours in zip(PROMPTS, images, batch.responses()):
        assert ours == _hf_greedy(hf, spec, prompt, pixels), prompt
    # the images matter: other pixels, other tokens
    other = [None if p is None else p.flip(0) + 1.0 for p in images]
    again = _engine(spec, model).generate(
        PROMPTS[:2], SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0), images=other[:2]
    )
    assert again.responses() != batch.responses()[:2]


def test_logprobs_equal_megatron_llava_and_samples_share_one_encoding(llava, monkeypatch):
    """Sampled at temperature 1 (n=3): each token's log-prob equals megatron-core's LLaVA forward
    over the prompt and the response (one image token per image, as the trainer runs it). The
    tower runs once per image, not once per sample."""
    import rl3d.rollout.vision as vision

    _, spec, model, images = llava
    towers = []

    def counted(w, pixels, tp):
        towers.append(len(pixels))
        return encode_images(w, pixels, tp)

    monkeypatch.setattr(vision, "encode_images", counted)
    engine = _engine(spec, model)
    batch = engine.generate(PROMPTS, SamplingParams(max_new_tokens=NEW_TOKENS, n=3, seed=7), images=images)
    assert towers == [3]  # one call, the 3 images of the 3 prompts; not 9
    assert batch.metrics["rollout/images_encoded"] == 3.0
    worst = 0.0
    vocab = spec.text.vocab_size
    for row, (response, logps) in enumerate(zip(batch.responses(), batch.token_logprobs())):
        prompt, pixels = PROMPTS[row // 3], images[row // 3]
        assert IMAGE not in response  # a generated image token would be an image to the trainer
        ids = torch.tensor([prompt + response])
        pixels = pixels if pixels is not None else torch.zeros(0, 3, 16, 16)
        with torch.no_grad():
            logits, _ = model(pixels, ids, torch.arange(ids.shape[1])[None], None)
        # megatron widens each image to num_image_tokens positions: response token s is predicted
        # by the last position before it
        widened = len(hf_input_ids(prompt, spec))
        logp = torch.log_softmax(logits[0, widened - 1 : -1, :vocab].float(), -1)
        ref = logp.gather(-1, torch.tensor(response)[:, None])[:, 0]
        worst = max(worst, (torch.tensor(logps) - ref).abs().max().item())
    assert worst < 1e-5, worst  # measured: 9.5e-7 (fp32)
    # the 3 samples of a prompt differ (sampled), each from the same encoding
    assert len({tuple(r) for r in batch.responses()[:3]}) > 1


def test_chunks_encode_their_own_prompts(llava):
    """max_batch_rows splits the prompts into chunks: each chunk encodes its prompts' images, the
    output equals one chunk's."""
    _, spec, model, images = llava
    params = SamplingParams(max_new_tokens=6, temperature=0.0, n=2)
    one = _engine(spec, model).generate(PROMPTS, params, images=images)
    chunked_engine = _engine(spec, model, max_batch_rows=2)
    chunked = chunked_engine.generate(PROMPTS, params, images=images)
    assert chunked.responses() == one.responses()
    assert chunked.metrics["rollout/images_encoded"] == 3.0


def test_bad_inputs_name_the_prompt(llava):
    _, spec, model, images = llava
    engine, params = _engine(spec, model), SamplingParams(max_new_tokens=2, temperature=0.0)
    counts = r"prompt 1 holds 2 image token\(s\) \(id 250\) but images\[1\] has 1"
    with pytest.raises(ValueError, match=counts):
        engine.generate(PROMPTS[:2], params, images=[images[0], images[1][:1]])
    with pytest.raises(ValueError, match="prompt 0 holds 1 image"):
        engine.generate(PROMPTS[:1], params)
    with pytest.raises(ValueError, match=r"images\[0\] has shape \(1, 3, 8, 8\)"):
        engine.generate(PROMPTS[:1], params, images=[torch.zeros(1, 3, 8, 8)])
    with pytest.raises(ValueError, match="2 prompts but 1 entries"):
        engine.generate(PROMPTS[:2], params, images=images[:1])
    tensors = {n: p.detach() for n, p in model.named_parameters() if "vision_projection" not in n}
    with pytest.raises(ValueError, match="lack 4 vision tower / projector parameters"):
        LlavaRolloutEngine(spec, tensors)


def test_the_transitions_parameter_list_is_the_models(llava):
    """`llava_params` (what the 3D-HybridEngine plans over) names every parameter of the built
    LLaVAModel with its shape and the split megatron-core trains it under; the plan of t=2 ->
    t_g=1 counts every element, the tower's and projector's included."""
    from rl3d.hybrid_engine.vision_plan import llava_params, plan_llava_transition, vision_params
    from rl3d.models.llava_mapping import llava_shard_kinds
    from rl3d.parallel import ParallelLayout

    _, spec, model, _ = llava
    params = {p.name: p for p in llava_params(spec, train_tp=1) if not p.tied_copy}
    built = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert {n: p.shape for n, p in params.items()} == built
    padded = model.language_model.vocab_size
    assert {n: p.kind for n, p in params.items()} == llava_shard_kinds(spec, list(built), padded)
    vision = vision_params(spec)
    assert len(vision) == 5 + 12 * spec.vision_layers + 4
    plan = plan_llava_transition(spec, ParallelLayout(1, 2, 1), 1, dtype="float32")
    elements = sum(p.numel for p in llava_params(spec, train_tp=2) if not p.tied_copy)
    assert plan.model_bytes == 4 * elements
    # each rank of t=2 receives the other's TP shard: half of every TP-split tensor
    split = sum(
        p.numel for p in llava_params(spec, train_tp=2) if p.kind.tp_dim is not None and not p.tied_copy
    )
    ranks = plan.strategies["hybridflow"].ranks
    assert [r.recv_bytes for r in ranks] == [4 * split // 2] * 2


def test_bf16_engine_casts_the_tower_too(llava):
    """`dtype=bfloat16` (rollout.dtype): the tower and projector run in bf16 beside the decoder;
    the sampled tokens' log-probs stay near megatron-core's fp32 forward on the same tokens."""
    _, spec, model, images = llava
    params = SamplingParams(max_new_tokens=NEW_TOKENS, n=2, seed=3)
    low = _engine(spec, model, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for ps in low.vision.pieces.values() for p in ps)
    batch = low.generate(PROMPTS, params, images=images)
    assert batch.metrics["rollout/images_encoded"] == 3.0
    worst = 0.0
    for row, (response, logps) in enumerate(zip(batch.responses(), batch.token_logprobs())):
        prompt, pixels = PROMPTS[row // 2], images[row // 2]
        pixels = pixels if pixels is not None else torch.zeros(0, 3, 16, 16)
        ids = torch.tensor([prompt + response])
        with torch.no_grad():
            logits, _ = model(pixels, ids, torch.arange(ids.shape[1])[None], None)
        widened = len(hf_input_ids(prompt, spec))
        logp = torch.log_softmax(logits[0, widened - 1 : -1, : spec.text.vocab_size], -1)
        ref = logp.gather(-1, torch.tensor(response)[:, None])[:, 0]
        worst = max(worst, (torch.tensor(logps) - ref).abs().max().item())
    assert worst < 0.05, worst  # measured: 8.1e-3 against megatron-core's fp32 forward
