"""LLaVA through megatron-core's LLaVAModel on CPU (local specs, gloo world of 1): a tiny random
transformers LlavaForConditionalGeneration (CLIP tower, projector, Llama decoder) saved with
`save_pretrained`, its config.json read into a LlavaSpec, its safetensors loaded, and the logits
compared on image+text inputs."""

import json

import pytest
import torch

from rl3d.models.llava import (
    build_llava,
    llava_input_ids,
    llava_spec_from_hf_config,
    load_llava_state_dict,
    load_llava_weights,
    no_images,
    read_llava_config,
)
from rl3d.testing.tiny_hf import make_tiny_llava

IMAGE = 250


@pytest.fixture(scope="module")
def tiny_llava(tmp_path_factory):
    model = make_tiny_llava(seed=5, image_token_id=IMAGE)
    directory = tmp_path_factory.mktemp("llava")
    model.save_pretrained(str(directory))
    return model, directory


def _row(n: int) -> torch.Tensor:
    """Text, an image, text, another image, text: as HF's processor expands `<image>`."""
    return torch.tensor([[1, 7, 9, *[IMAGE] * n, 11, 12, *[IMAGE] * n, 13, 14, 15]])


def test_logits_match_transformers_on_images_and_text(groups_1x1, tiny_llava):
    hf, directory = tiny_llava
    spec = read_llava_config(directory)
    assert (spec.vision_layers, spec.num_image_tokens, spec.drop_class_token) == (2, 16, True)
    model = build_llava(spec, groups_1x1)
    load_llava_weights(model, spec, directory, groups_1x1)
    model.eval()
    ids = _row(spec.num_image_tokens)
    pixels = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    ours_ids = llava_input_ids(ids, spec)
    assert ours_ids.shape[1] == ids.shape[1] - 2 * (spec.num_image_tokens - 1)
    with torch.no_grad():
        ref = hf(input_ids=ids, pixel_values=pixels).logits
        ours, _ = model(pixels, ours_ids, torch.arange(ours_ids.shape[1])[None], None)
        other, _ = model(pixels.flip(0), ours_ids, torch.arange(ours_ids.shape[1])[None], None)
    ours = ours[..., : spec.text.vocab_size]
    assert ours.shape == ref.shape == (1, ids.shape[1], spec.text.vocab_size)
    diff = (ours - ref).abs().max().item()
    assert diff < 1e-5, diff  # measured: 6.0e-7
    # the images matter: swapped, the logits after the first image differ
    assert (other[..., : spec.text.vocab_size] - ref).abs().max().item() > 1e-2
    assert torch.Tensor.cuda.__name__ == "cuda"  # the CPU shim's nested remaps are undone


def test_text_only_rows_and_a_batch_of_rows(groups_1x1, tiny_llava):
    """A text-only row (no images at all) and two rows with one image each at other positions."""
    hf, directory = tiny_llava
    spec = read_llava_config(directory)
    model = build_llava(spec, groups_1x1)
    load_llava_weights(model, spec, directory, groups_1x1)
    model.eval()
    n, vocab = spec.num_image_tokens, spec.text.vocab_size
    text = torch.tensor([[1, 7, 9, 11, 12, 13]])
    rows = torch.tensor([[1, 7, *[IMAGE] * n, 11, 12, 13], [1, 7, 9, 11, *[IMAGE] * n, 13]])
    pixels = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(2))
    ours_rows = llava_input_ids(rows, spec)
    with torch.no_grad():
        text_diff = (
            model(no_images(spec), text, torch.arange(6)[None], None)[0][..., :vocab] - hf(text).logits
        )
        positions = torch.arange(ours_rows.shape[1]).expand(2, -1)
        rows_diff = (
            model(pixels, ours_rows, positions, None)[0][..., :vocab]
            - hf(input_ids=rows, pixel_values=pixels).logits
        )
    assert text_diff.abs().max().item() < 1e-5  # measured: 6.1e-7
    assert rows_diff.abs().max().item() < 1e-5  # measured: 6.3e-7
    with pytest.raises(ValueError, match="shrink unequally"):
        llava_input_ids(torch.cat([rows[:1], torch.tensor([[1, *[7] * (n + 4)]])]), spec)


def test_gradients_match_transformers_and_the_tower_can_be_frozen(groups_1x1, tiny_llava):
    """The summed log-probability of the text's next tokens, differentiated on both sides: each
    megatron-core gradient, mapped to HF's tensors as the weights are, equals transformers'."""
    from rl3d.models.llava_mapping import llava_to_hf

    hf, directory = tiny_llava
    spec = read_llava_config(directory)
    model = build_llava(spec, groups_1x1)
    load_llava_weights(model, spec, directory, groups_1x1)
    ids = _row(spec.num_image_tokens)
    pixels = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    text = (ids[0, :-1] != IMAGE).nonzero()[:, 0]  # positions whose next token is predicted

    def objective(logits):
        logp = torch.log_softmax(logits[0, :-1, : spec.text.vocab_size], -1)
        return logp[text, ids[0, 1:][text]].sum()

    hf.zero_grad()
    objective(hf(input_ids=ids, pixel_values=pixels).logits).backward()
    ours_ids = llava_input_ids(ids, spec)
    objective(model(pixels, ours_ids, torch.arange(ours_ids.shape[1])[None], None)[0]).backward()
    grads = llava_to_hf(spec, {n: p.grad for n, p in model.named_parameters()})
    ref = {name: param.grad for name, param in _saved_names(hf).items() if param.grad is not None}
    assert set(grads) == set(ref)
    worst = max((grads[n] - ref[n]).abs().max().item() for n in ref)
    assert worst < 1e-5, worst  # measured: 2.4e-6 (max abs; the largest gradient is 8.1)
    model.zero_grad()
    model.freeze(freeze_language_model=False, freeze_vision_model=True, freeze_vision_projection=False)
    model(pixels, ours_ids, torch.arange(ours_ids.shape[1])[None], None)[0].sum().backward()
    assert all(p.grad is None for p in model.vision_model.parameters())
    assert all(p.grad is not None for p in model.vision_projection.parameters())


def _saved_names(hf):
    """HF's parameters under the names `save_pretrained` writes."""
    renames = (
        ("model.language_model.", "language_model.model."),
        ("lm_head.", "language_model.lm_head."),
        ("model.vision_tower.", "vision_tower."),
        ("model.multi_modal_projector.", "multi_modal_projector."),
    )
    out = {}
    for name, param in hf.named_parameters():
        for old, new in renames:
            if name.startswith(old):
                name = new + name[len(old) :]
                break
        out[name] = param
    return out


def test_module_names_load_as_the_saved_files_do(groups_1x1, tiny_llava):
    """transformers 5.x's module names (model.language_model.*, model.vision_tower.*) and what
    save_pretrained writes (language_model.model.*, vision_tower.*) give the same parameters."""
    hf, directory = tiny_llava
    spec = read_llava_config(directory)
    from_files, from_modules = build_llava(spec, groups_1x1), build_llava(spec, groups_1x1)
    load_llava_weights(from_files, spec, directory, groups_1x1)
    state = hf.state_dict()
    assert any(k.startswith("model.vision_tower.") for k in state)
    load_llava_state_dict(from_modules, spec, state, groups_1x1)
    hub = {k.replace("vision_tower.", "vision_tower.vision_model."): v for k, v in state.items()}
    for a, b in zip(from_files.parameters(), from_modules.parameters(), strict=True):
        assert torch.equal(a, b)
    load_llava_state_dict(from_modules, spec, hub, groups_1x1)  # the hub's LLaVA-1.5 files nest vision_model.
    del state["model.multi_modal_projector.linear_1.bias"]
    with pytest.raises(ValueError, match="no 'projector.linear_1.bias'"):
        load_llava_state_dict(from_modules, spec, state, groups_1x1)


def test_export_gives_the_hf_tensors_back_bit_for_bit(groups_1x1, tiny_llava):
    """HF files -> megatron-core -> HF names and tensors: every tensor LLaVA reads comes back
    equal (the CLIP layer past the feature layer and post_layernorm are not read, not held)."""
    from safetensors.torch import load_file

    from rl3d.models.llava_mapping import llava_to_hf

    _, directory = tiny_llava
    spec = read_llava_config(directory)
    model = build_llava(spec, groups_1x1)
    load_llava_weights(model, spec, directory, groups_1x1)
    exported = llava_to_hf(spec, {n: p.detach() for n, p in model.named_parameters()})
    saved = load_file(str(directory / "model.safetensors"))
    unread = {k for k in saved if "post_layernorm" in k or ".layers.2." in k and "vision_tower" in k}
    assert unread and set(exported) == set(saved) - unread
    for name, tensor in exported.items():
        assert tensor.dtype == saved[name].dtype and torch.equal(tensor, saved[name]), name


def test_image_token_runs_must_be_whole_images(tiny_llava):
    spec = read_llava_config(tiny_llava[1])
    assert llava_input_ids(_row(16), spec).tolist() == [[1, 7, 9, IMAGE, 11, 12, IMAGE, 13, 14, 15]]
    assert llava_input_ids(torch.tensor([[1, 2, 3]]), spec).tolist() == [[1, 2, 3]]
    adjacent = torch.tensor([[1, *[IMAGE] * 32, 2]])  # "<image><image>" as HF widens it
    assert llava_input_ids(adjacent, spec).tolist() == [[1, IMAGE, IMAGE, 2]]
    short = torch.tensor([[1, *[IMAGE] * 16, 2, *[IMAGE] * 15, 3]])
    with pytest.raises(ValueError, match=r"image token runs of \[16, 15\], expected multiples of 16"):
        llava_input_ids(short, spec)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"model_type": "qwen2_vl"}, "is not 'llava'"),
        ({"vision_feature_layer": [-2, -5]}, "vision_feature_layer"),
        ({"vision_feature_select_strategy": "cls"}, "vision_feature_select_strategy"),
        ({"projector_hidden_act": "relu"}, "projector_hidden_act 'relu'"),
        ({"multimodal_projector_bias": False}, "multimodal_projector_bias"),
        ({"vision_config": {"model_type": "siglip_vision_model"}}, "CLIP only"),
    ],
)
def test_config_refusals_name_the_key(tiny_llava, change, message):
    cfg = json.loads((tiny_llava[1] / "config.json").read_text())
    llava_spec_from_hf_config(cfg)
    with pytest.raises(ValueError, match=message):
        llava_spec_from_hf_config({**cfg, **change})
