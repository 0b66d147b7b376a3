"""rl3d's SGLang LoRA push against the pinned sglang wheel's source (read with `ast`, never
imported): the engine fields that enable LoRA exist, the adapter loads through
`load_lora_adapter_from_tensors` with PEFT's names and adapter_config.json's dict (no file), the
answer it checks has `success` / `error_message`, requests name the adapter in `lora_path`, and
every projection rl3d adapts is one SGLang supports. Skipped, saying why, without the wheel."""

import ast

import pytest
from sglang_wheel import param_names, wheel_or_skip

from rl3d.models.lora_names import LORA_TARGETS
from rl3d.rollout.lora import AdapterConfig
from rl3d.rollout.sglang_lora import peft_config_dict, sglang_lora_server_args
from rl3d.rollout.sglang_weights import REQUIRED_ENGINE_API

ENGINE = "sglang/srt/entrypoints/engine.py"


@pytest.fixture(scope="module")
def wheel():
    return wheel_or_skip()


def test_lora_server_args_exist_and_cover_every_target(wheel):
    args = sglang_lora_server_args({"r": 16, "lora_alpha": 32, "target_modules": list(LORA_TARGETS)})
    assert set(args) <= wheel.server_args_fields(), sorted(set(args) - wheel.server_args_fields())
    assert args["max_lora_rank"] == 16 and args["enable_lora"] is True
    common = wheel.tree("sglang/srt/utils/common.py")
    supported = next(
        ast.literal_eval(n.value) for n in common.body
        if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "SUPPORTED_LORA_TARGET_MODULES"
    )  # fmt: skip
    assert set(LORA_TARGETS) <= set(supported), sorted(set(LORA_TARGETS) - set(supported))


def test_adapter_push_binds_to_the_engine_methods(wheel):
    methods = wheel.engine_methods()
    for method in ("load_lora_adapter_from_tensors", "unload_lora_adapter"):
        names, _ = param_names(methods[method])
        assert set(REQUIRED_ENGINE_API[method]) <= names, (method, names)
    names, _ = param_names(methods["generate"])
    assert "lora_path" in names
    # the tensors go as they are (one serialized copy per TP rank), no path on disk
    body = ast.unparse(methods["load_lora_adapter_from_tensors"])
    assert "_serialize_tensors_per_rank(tensors" in body and "config_dict=config_dict" in body


def test_sglang_reads_peft_names_and_the_config_dict(wheel):
    """The adapter's tensors are filed by the layer index in their name, as PEFT's saved names
    carry it; the answer rl3d checks has the fields it reads."""
    lora = wheel.text("sglang/srt/lora/lora.py")
    assert "def initialize_weights_from_tensors(self, tensors" in lora
    assert "layer_id = get_layer_id(name)" in lora
    fields = wheel.dataclass_fields("sglang/srt/managers/io_struct.py", "LoRAUpdateOutput")
    assert {"success", "error_message"} <= set(fields)
    req = wheel.dataclass_fields("sglang/srt/managers/io_struct.py", "LoadLoRAAdapterFromTensorsReqInput")
    assert {"lora_name", "config_dict", "serialized_named_tensors"} <= set(req)
    manager = wheel.text("sglang/srt/lora/lora_manager.py")
    assert "def load_lora_adapter_from_tensors(" in manager
    config = peft_config_dict(AdapterConfig(8, 16.0, ("q_proj",)))
    assert config["r"] == 8 and config["lora_alpha"] == 16.0 and config["target_modules"] == ["q_proj"]
    assert config["peft_type"] == "LORA"  # what SGLang's LoRAConfig reads from adapter_config.json


def test_released_weights_keep_their_values_with_the_cpu_backup(wheel):
    """The adapter transition pushes the base once and resumes it every step: the wheel puts the
    weights in the memory saver's "weights" region with a CPU backup when
    `enable_weights_cpu_backup` is set (the LoRA server args set it), unless the weights are
    IPC-mapped from a weight-cache daemon (`weight_cache_mode`, "off" by default; rl3d never
    sets it)."""
    args = sglang_lora_server_args({"r": 8, "target_modules": ["q_proj"]})
    assert args["enable_weights_cpu_backup"] is True
    load = wheel.text("sglang/srt/model_executor/model_runner_components/load_model_utils.py")
    assert "enable_cpu_backup = get_exec().features.enable_weights_cpu_backup" in load
    assert "GPU_MEMORY_TYPE_WEIGHTS,\n        enable_cpu_backup=enable_cpu_backup," in load
    assert 'is_ipc_zero_copy = get_model().weight_cache_mode != "off"' in load
    model_fields = wheel.text("sglang/srt/arg_groups/fields/model.py")
    assert '"daemon", "client"],\n        ),\n    ] = "off"' in model_fields
    assert "weight_cache_mode" not in args
