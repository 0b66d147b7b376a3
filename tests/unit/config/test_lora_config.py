"""`actor.lora`: off by default; its keys checked where they are set, each error naming the key."""

import pytest

from rl3d.config import load_config
from rl3d.config.errors import ConfigError

RECIPE = "recipes/quickstart_cpu_grpo.yaml"


def test_off_by_default_and_all_linear_resolves_in_forward_order():
    assert load_config(RECIPE, []).config.actor.lora is None
    lora = load_config(RECIPE, ["actor.lora.rank=4", "actor.lora.alpha=8"]).config.actor.lora
    assert lora.targets == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    assert lora.scaling == 2.0
    rs = load_config(RECIPE, ["actor.lora.rank=4", "actor.lora.alpha=8", "actor.lora.use_rslora=true"])
    assert rs.config.actor.lora.scaling == 4.0
    picked = load_config(RECIPE, ["actor.lora.target_modules=[v_proj,q_proj]"]).config.actor.lora
    assert picked.targets == ("q_proj", "v_proj")
    assert not picked.lm_head and picked.peft_targets == ("q_proj", "v_proj")
    head = load_config(RECIPE, ["actor.lora.target_modules=[all-linear,lm_head]"]).config.actor.lora
    assert head.lm_head and len(head.targets) == 7 and head.peft_targets[-1] == "lm_head"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["actor.lora.rank=0"], "actor.lora.rank: must be > 0"),
        (
            ["actor.lora.target_modules=[qproj]"],
            "actor.lora.target_modules: unknown module 'qproj' (did you mean 'q_proj'?)",
        ),
        (["actor.lora.target_modules=[]"], "actor.lora.target_modules: name at least one"),
        (["actor.lora.init=/no/such/adapter"], "actor.lora.init: no such PEFT adapter directory"),
        (["actor.lora.dropout=0.1"], "actor.lora.dropout: 0.1 needs actor.parallel.tp: 1"),
        (["actor.lora.rank=8", "model.dtype=float16"], "actor.lora: needs model.dtype bfloat16 or float32"),
        (
            ["actor.lora.rank=8", "reference.colocate=false", "launch.nproc_per_node=3"],
            "reference.colocate: false builds a reference model",
        ),
    ],
)
def test_bad_settings_are_refused_by_key(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(RECIPE, overrides)
    assert message in str(err.value)


def test_packing_on_cuda_is_refused_transformer_engine_fuses_the_norm_into_the_linear():
    with pytest.raises(ConfigError, match="actor.lora: does not run on Transformer Engine"):
        load_config("recipes/gpu_llama2_7b_grpo.yaml", ["actor.lora.rank=8", "actor.packing=true"])


def test_adapter_transition_where_the_engine_keeps_the_base():
    """`auto` moves only adapters to the colocated torch engine, merged weights elsewhere;
    `adapters` where it cannot run is refused by key."""
    from rl3d.config.lora import adapter_transition

    assert adapter_transition(load_config(RECIPE, ["actor.lora.rank=4"]).config)
    assert not adapter_transition(load_config(RECIPE, []).config)  # no LoRA
    merged = ["actor.lora.rank=4", "actor.lora.transition=merged"]
    assert not adapter_transition(load_config(RECIPE, merged).config)
    pool = "recipes/quickstart_cpu_grpo_async.yaml"  # a separate rollout pool
    assert not adapter_transition(load_config(pool, ["actor.lora.rank=4"]).config)
    with pytest.raises(ConfigError, match="'adapters' does not run here: a separate rollout pool"):
        load_config(pool, ["actor.lora.rank=4", "actor.lora.transition=adapters"])
    head = ["actor.lora.target_modules=[q_proj,lm_head]"]
    assert not adapter_transition(load_config(RECIPE, head).config)  # lm_head goes merged
    with pytest.raises(ConfigError, match="'adapters' does not run here: an adapted lm_head"):
        load_config(RECIPE, [*head, "actor.lora.transition=adapters"])
    with pytest.raises(ConfigError, match="actor.lora.engine_mode"):
        load_config(RECIPE, ["actor.lora.engine_mode=fuse"])
    # SGLang: merged unless asked (it decodes adapters through its LoRA kernels), and its base
    # survives the memory saver's release only with the CPU backup the memory saver gives
    sglang = ["actor.lora.rank=4", "rollout.engine=sglang", "launch.device=cuda", "model.hf_path=/hf"]
    sglang += ["actor.packing=false"]
    assert not adapter_transition(load_config(RECIPE, sglang).config)
    assert adapter_transition(load_config(RECIPE, [*sglang, "actor.lora.transition=adapters"]).config)
    with pytest.raises(ConfigError, match="'adapters' does not run here: SGLang keeps the base"):
        no_saver = "rollout.sglang.enable_memory_saver=false"
        load_config(RECIPE, [*sglang, "actor.lora.transition=adapters", no_saver])
