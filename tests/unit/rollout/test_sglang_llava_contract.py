"""LLaVA against the pinned sglang wheel's source (read with `ast`, never imported): the
multimodal request path an rl3d adapter would use and the weight names rl3d's LLaVA export
writes. What the source shows about the CLIP tower's class is pinned too (docs/vlm.md). Skipped,
saying why, where the wheel cannot be downloaded."""

import ast

import pytest
from sglang_wheel import param_names, wheel_or_skip

LLAVA = "sglang/srt/models/llava.py"


@pytest.fixture(scope="module")
def wheel():
    return wheel_or_skip()


def _strings(node: ast.AST) -> set[str]:
    return {n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def test_multimodal_request_path(wheel):
    """`Engine.generate(input_ids=..., image_data=[[img, ...], ...])`: one list of images per
    prompt; a prompt with more than one image is marked "multi-images", the modality under which
    LLaVA's processor encodes every image (under "image" it takes image_data[0] alone)."""
    names, _ = param_names(wheel.engine_methods()["generate"])
    assert {"input_ids", "image_data", "sampling_params", "return_logprob"} <= names
    io = wheel.class_node("sglang/srt/managers/io_struct.py", "GenerateReqInput")
    normalize = next(
        n for n in io.body if isinstance(n, ast.FunctionDef) and n.name == "_normalize_image_data"
    )
    assert {"image", "multi-images"} <= _strings(normalize)
    processor = wheel.text("sglang/srt/multimodal/processors/llava.py")
    assert '"multi-images" in modalities' in processor and "image_data[0]" in processor
    served = wheel.class_node("sglang/srt/multimodal/processors/llava.py", "LlavaMultimodalProcessor")
    models = next(n for n in served.body if isinstance(n, ast.Assign) and n.targets[0].id == "models")
    assert "LlavaForConditionalGeneration" in {
        n.id for n in ast.walk(models.value) if isinstance(n, ast.Name)
    }


def _entry_classes(wheel) -> set[str]:
    """Every architecture sglang's model registry holds: the names in each models/*.py's EntryClass."""
    out: set[str] = set()
    for info in wheel._zip.infolist():
        name = info.filename
        if not (name.startswith("sglang/srt/models/") and name.endswith(".py")) or name.count("/") != 3:
            continue
        for node in wheel.tree(name).body:
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "EntryClass" for t in node.targets
            ):
                out |= {n.id for n in ast.walk(node.value) if isinstance(n, ast.Name)}
    return out


def test_weight_names_of_the_export_reach_sglangs_llava_loader(wheel):
    """`llava_to_hf`'s names (save_pretrained's) are what sglang's LlavaForConditionalGeneration
    loads: `language_model.*` and `vision_tower.*` go to those submodules' own loaders, the rest to
    its own parameters, which are transformers' `LlavaMultiModalProjector`'s."""
    from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

    from rl3d.models.llava import llava_spec_from_hf_config
    from rl3d.models.llava_mapping import llava_to_hf, llava_to_megatron
    from rl3d.testing.tiny_hf import make_tiny_llava

    cls = wheel.class_node(LLAVA, "LlavaForConditionalGeneration")
    load = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "load_weights")
    assert {"language_model", "vision_tower"} <= _strings(load)
    projector = next(
        n for n in cls.body if isinstance(n, ast.Assign) and n.targets[0].id == "MULTIMODAL_PROJECTOR_TYPE"
    )
    assert projector.value.id == "LlavaMultiModalProjector"
    assert "from transformers.models.llava.modeling_llava import LlavaMultiModalProjector" in wheel.text(
        LLAVA
    )

    hf = make_tiny_llava(seed=1)
    spec = llava_spec_from_hf_config(hf.config.to_dict())
    names = set(llava_to_hf(spec, llava_to_megatron(spec, hf.state_dict(), padded_vocab=256)))
    own = {n for n in names if not n.startswith(("language_model.", "vision_tower."))}
    projector_params = {
        f"multi_modal_projector.{n}" for n, _ in LlavaMultiModalProjector(hf.config).named_parameters()
    }
    assert own == projector_params
    # the decoder's names, prefix stripped, are a Llama's (model.*, lm_head.*): sglang's Llama loader
    decoder = {n[len("language_model.") :].split(".")[0] for n in names if n.startswith("language_model.")}
    assert decoder == {"model", "lm_head"}


def test_the_clip_tower_class_sglang_resolves(wheel):
    """sglang builds LLaVA's tower as the registry's class for the architecture transformers'
    AutoModel maps CLIPVisionConfig to. That is `CLIPVisionModel`, which no EntryClass of the
    wheel declares (clip.py's is CLIPModel); the registry then falls back to its
    `TransformersForCausalLM`. Pinned so that a new wheel which registers the tower shows up."""
    from transformers import AutoModel, CLIPVisionConfig

    arch = AutoModel._model_mapping[CLIPVisionConfig].__name__
    assert arch == "CLIPVisionModel"
    llava = wheel.text(LLAVA)
    assert "self._get_sgl_model_cls(self.vision_config, AutoModel)" in llava
    archs = _entry_classes(wheel)
    assert (
        "CLIPModel" in archs
        and "TransformersForCausalLM" in archs
        and "LlavaForConditionalGeneration" in archs
    )
    assert arch not in archs
    assert 'normalized_arch.append("TransformersForCausalLM")' in wheel.text("sglang/srt/models/registry.py")
