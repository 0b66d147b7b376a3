"""LoRA on the megatron actor against real `peft` on the HF model (fp32, one rank): an adapter
made by peft initialises the actor's adapters and gives the same logits; the actor's adapters
exported as a PEFT directory load back into peft with the same logits; `--merge`'s weights equal
peft's own merge; disabled adapters give the base."""

import json

import pytest
import torch

from rl3d.config.lora import LoraConfig
from rl3d.engine import Features, InitialWeights, MegatronEngine
from rl3d.engine.techniques import Lora
from rl3d.models.hf_mapping import spec_from_hf_config
from rl3d.models.lora_peft import load_peft_adapter, merge_into_hf, save_peft_adapter

peft = pytest.importorskip("peft")
TOL = 1e-5  # fp32 logits, megatron vs HF kernels


def _peft_adapter(hf_dir, out_dir, targets, *, rank=4, alpha=8.0, seed=0):
    """A PEFT adapter made by peft itself, with random B (peft starts B at zero)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(hf_dir)
    model = peft.get_peft_model(hf, peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets)))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    model.save_pretrained(out_dir)
    return out_dir


def _lora_actor(spec, groups, hf_dir, lora):
    """A forward-only actor with `hf_dir`'s weights and `lora`'s adapters."""
    return MegatronEngine(
        spec,
        groups,
        role="actor",
        params_dtype=torch.float32,
        seed=3,
        weights=InitialWeights(hf_path=str(hf_dir)),
        features=Features([Lora(lora)]),
    )


def _logits(role, spec, ids):
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    role.unwrapped().eval()
    with torch.no_grad():
        return role.unwrapped()(ids, pos, None)[..., : spec.vocab_size]


def _hf_logits(hf_dir, ids, adapter_dir=None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir)
    if adapter_dir is not None:
        model = peft.PeftModel.from_pretrained(model, adapter_dir)
    with torch.no_grad():
        return model.eval()(ids).logits


@pytest.mark.parametrize(
    ("name", "targets"),
    [
        ("tiny-llama", ["q_proj", "v_proj"]),
        ("tiny-qwen2", ["all-linear"]),
        ("tiny-llama", ["k_proj", "up_proj", "o_proj"]),
        ("tiny-llama", ["q_proj", "v_proj", "lm_head"]),
    ],
)
def test_a_peft_adapter_loads_into_the_actor_with_peft_s_logits_and_exports_back(
    groups_1x1, tiny_hf_dirs, tmp_path, name, targets
):
    hf_dir = tiny_hf_dirs[name]
    spec = spec_from_hf_config(json.loads((hf_dir / "config.json").read_text()))
    lora = LoraConfig(rank=4, alpha=8.0, target_modules=targets, init=None)
    peft_targets = list(lora.peft_targets)  # peft's own "all-linear" would also take lm_head
    made = _peft_adapter(hf_dir, tmp_path / "made", peft_targets)
    lora = LoraConfig(rank=4, alpha=8.0, target_modules=targets, init=str(made))
    role = _lora_actor(spec, groups_1x1, hf_dir, lora)
    ids = torch.randint(0, spec.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    ours = _logits(role, spec, ids)
    assert (ours - _hf_logits(hf_dir, ids, made)).abs().max() < TOL
    base = _hf_logits(hf_dir, ids)
    assert (ours - base).abs().max() > 100 * TOL  # the adapters matter
    with role.adapters_disabled():
        assert (_logits(role, spec, ids) - base).abs().max() < TOL

    state = role.lora_state_dict()
    assert state.keys() == load_peft_adapter(made, lora).keys()
    out = save_peft_adapter(tmp_path / "export", state, lora, base=str(hf_dir))
    assert (ours - _hf_logits(hf_dir, ids, out)).abs().max() < TOL


def test_merged_weights_equal_peft_s_merge(tiny_hf_dirs, tmp_path):
    from transformers import AutoModelForCausalLM

    hf_dir = tiny_hf_dirs["tiny-llama"]
    spec = spec_from_hf_config(json.loads((hf_dir / "config.json").read_text()))
    lora = LoraConfig(rank=4, alpha=8.0, target_modules=["all-linear", "lm_head"])
    made = _peft_adapter(hf_dir, tmp_path / "made", lora.peft_targets, seed=2)
    base = AutoModelForCausalLM.from_pretrained(hf_dir).state_dict()
    ours = merge_into_hf(
        base, load_peft_adapter(made, lora), scaling=lora.scaling, num_layers=spec.num_layers
    )
    theirs = peft.PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(hf_dir), made
    ).merge_and_unload()
    for k, v in theirs.state_dict().items():
        assert (ours[k] - v).abs().max() < 1e-6, k


def test_lm_head_on_a_model_that_ties_it_to_the_embedding_is_refused(groups_1x1, tiny_hf_dirs):
    hf_dir = tiny_hf_dirs["tiny-qwen2"]
    spec = spec_from_hf_config(json.loads((hf_dir / "config.json").read_text()))
    lora = LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "lm_head"])
    with pytest.raises(ValueError, match="actor.lora.target_modules: lm_head needs an untied output layer"):
        _lora_actor(spec, groups_1x1, hf_dir, lora)


def test_an_adapter_that_disagrees_with_actor_lora_is_refused_by_name(tiny_hf_dirs, tmp_path):
    made = _peft_adapter(tiny_hf_dirs["tiny-llama"], tmp_path / "made", ["q_proj"], rank=4)
    with pytest.raises(ValueError, match="adapter_config.json: r is 4, actor.lora has 8"):
        load_peft_adapter(made, LoraConfig(rank=8, target_modules=["q_proj"]))
    with pytest.raises(ValueError, match="target_modules"):
        load_peft_adapter(made, LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj"]))
