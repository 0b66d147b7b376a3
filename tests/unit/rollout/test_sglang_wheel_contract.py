"""rl3d's SGLang adapter against the pinned sglang wheel's source (read with `ast`, never imported):
every method, keyword, server-args field, sampling key and import rl3d uses exists under that
name; the engine factory's call sites bind to the engine classes' real signatures; the wheel's
pins agree with setup.py and the Makefile. Skipped, saying why, where the wheel cannot be
downloaded."""

import ast
import inspect
import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from sglang_wheel import ROOT, param_names, wheel_or_skip

from rl3d.config.schema import RolloutConfig, SGLangConfig
from rl3d.models.spec import get_model_spec
from rl3d.rollout import SamplingParams
from rl3d.rollout.factory import ENGINES, build_rollout_engine, engine_class, engine_kwargs
from rl3d.rollout.sglang_weights import (
    REQUIRED_ENGINE_API,
    SGLANG_CHILD_ENV,
    SGLANG_VERSION,
    BucketEntry,
    sglang_server_args,
    to_sglang_sampling,
)

SRC = ROOT / "src" / "rl3d"
ADAPTER = SRC / "rollout" / "sglang_engine.py"


@pytest.fixture(scope="module")
def wheel():
    return wheel_or_skip()


def test_the_wheel_is_the_pinned_version(wheel):
    assert wheel.version() == SGLANG_VERSION


def _engine_uses() -> dict[str, set[str]]:
    """Every `self.engine.<method>` the adapter names, with the keywords it passes (also through
    `threading.Thread(target=self.engine.m, kwargs=dict(...))`)."""
    uses: dict[str, set[str]] = {}
    for node in ast.walk(ast.parse(ADAPTER.read_text())):
        if isinstance(node, ast.Attribute) and ast.unparse(node.value) == "self.engine":
            uses.setdefault(node.attr, set())
        if not isinstance(node, ast.Call):
            continue
        if isinstance(node.func, ast.Attribute) and ast.unparse(node.func.value) == "self.engine":
            uses.setdefault(node.func.attr, set()).update(k.arg for k in node.keywords)
        kw = {k.arg: k.value for k in node.keywords}
        target = kw.get("target")
        if isinstance(target, ast.Attribute) and ast.unparse(target.value) == "self.engine":
            passed = kw.get("kwargs")
            if isinstance(passed, ast.Call):
                uses.setdefault(target.attr, set()).update(k.arg for k in passed.keywords)
    uses.pop("server_args", None)  # an attribute, checked below
    return uses


def test_every_engine_method_and_keyword_exists(wheel):
    methods = wheel.engine_methods()
    uses = _engine_uses()
    assert {"generate", "update_weights_from_tensor", "begin_weight_update"} <= set(uses)
    for method, keywords in uses.items():
        assert method in REQUIRED_ENGINE_API, f"the adapter calls Engine.{method}, not in REQUIRED_ENGINE_API"
        assert keywords <= set(REQUIRED_ENGINE_API[method]), (method, keywords)
    for method, keywords in REQUIRED_ENGINE_API.items():
        assert method in methods, f"sglang {SGLANG_VERSION} Engine has no {method}"
        names, var_kw = param_names(methods[method])
        assert var_kw or set(keywords) <= names, (method, sorted(set(keywords) - names))
    assert "tp_size" in wheel.server_args_fields()  # self.engine.server_args.tp_size


def test_every_server_arg_exists(wheel):
    fields = wheel.server_args_fields()
    args = sglang_server_args(
        model_path="/hf", tp_size=2, base_gpu_id=0, gpu_id_step=1, mem_fraction_static=0.5,
        enable_memory_saver=True, deterministic=True, dtype="bfloat16", seed=0, max_total_tokens=4096,
    )  # fmt: skip
    assert args["max_total_tokens"] == 4096
    assert set(args) <= fields, sorted(set(args) - fields)
    assert {"disable_cuda_graph", "log_level"} <= fields  # what tests/gpu passes as engine_kwargs


def test_the_engine_starts_from_dummy_weights_the_wheel_accepts(wheel):
    args = sglang_server_args(
        model_path="/hf", tp_size=1, base_gpu_id=0, gpu_id_step=1, mem_fraction_static=0.5,
        enable_memory_saver=True, deterministic=False, dtype="bfloat16",
    )  # fmt: skip
    assert args["load_format"] == "dummy" and args["enable_deterministic_inference"] is False
    choices = next(
        n.value for n in wheel.tree("sglang/srt/arg_groups/choices.py").body
        if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "LOAD_FORMAT_CHOICES"
    )  # fmt: skip
    assert "dummy" in ast.literal_eval(choices)
    assert 'DUMMY = "dummy"' in wheel.text("sglang/srt/configs/load_config.py")


def test_sglang_installs_a_sigquit_handler_in_the_launching_process(wheel):
    """What rl3d's launch undoes: `_set_envs_and_config` (run in the trainer's process) sets
    SIGQUIT's handler to one that kills the whole process tree."""
    fn = wheel.function_node("sglang/srt/entrypoints/engine.py", "_set_envs_and_config")
    calls = [ast.unparse(n) for n in ast.walk(fn) if isinstance(n, ast.Call)]
    assert "signal.signal(signal.SIGQUIT, launch_phase_sigquit_handler)" in calls
    assert "kill_process_tree(os.getpid())" in calls


def test_every_sampling_key_exists_and_ignore_eos_covers_stop_ids(wheel):
    fields = wheel.sampling_param_fields()
    cases = [(SamplingParams(seed=3, stop_token_ids=(2, 5), top_k=4), {2}), (SamplingParams(), {2})]
    for params, eos in cases:
        keys = set(to_sglang_sampling(params, 1, eos))
        assert keys <= fields, sorted(keys - fields)
    # rl3d's ignore_eos rule rests on this: ignore_eos turns stop ids off too
    finish = wheel.class_node("sglang/srt/managers/schedule_batch.py", "Req")
    check = next(n for n in finish.body if getattr(n, "name", "") == "_check_token_based_finish")
    assert ast.unparse(check.body[0]).startswith("if self.sampling_params.ignore_eos:\n    return False")
    # and the model's EOS ids are config.json's united with generation_config.json's
    cfg = wheel.text("sglang/srt/configs/model_config.py")
    assert 'getattr(self.hf_config, "eos_token_id"' in cfg and "hf_generation_config" in cfg


def test_raw_logprob_flag_and_seed_need(wheel):
    for name in SGLANG_CHILD_ENV:
        assert name in wheel.environ_flags(), name
        assert name in wheel.text("sglang/srt/layers/sampler.py"), name
    batch_info = wheel.text("sglang/srt/sampling/sampling_batch_info.py")
    assert re.search(r"sampling_seed = \(.*?if enable_deterministic\s+else None", batch_info, re.S)


def test_every_sglang_import_exists(wheel):
    found = 0
    for path in (SRC / "rollout").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "sglang":
                for alias in node.names:
                    assert wheel.defines(node.module, alias.name), f"{path.name}: {node.module}.{alias.name}"
                    found += 1
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "sglang":
                        assert wheel.module_file(alias.name), alias.name
    assert found >= 5
    assert wheel.defines("sglang", "Engine") and wheel.defines("sglang", "__version__")


def test_memory_tags_and_their_rules(wheel):
    assert wheel.memory_types() == ["kv_cache", "weights", "cuda_graph"]
    manager = wheel.class_node("sglang/srt/managers/scheduler_components/weight_updater.py",
                               "SchedulerWeightUpdaterManager")  # fmt: skip
    body = {n.name: ast.unparse(n) for n in manager.body if isinstance(n, ast.FunctionDef)}
    assert "self.offload_tags.remove(tag)" in body["resume_memory_occupation"]  # unreleased: KeyError
    for update in ("update_weights_from_tensor", "update_weights_from_distributed"):
        assert "if self._session is None:" in body[update]  # begin/end_weight_update around it


def test_releasing_the_kv_cache_empties_sglangs_allocator_cache(wheel):
    """The colocated engine releases every tag after each rollout (`release_memory()`, the
    memory saver on by default): releasing the KV cache also flushes SGLang's pools and empties
    its scheduler's allocator cache, so none of SGLang's runtime memory stays reserved while
    the trainer trains."""
    assert SGLangConfig().enable_memory_saver
    manager = wheel.class_node("sglang/srt/managers/scheduler_components/weight_updater.py",
                               "SchedulerWeightUpdaterManager")  # fmt: skip
    body = {n.name: ast.unparse(n) for n in manager.body if isinstance(n, ast.FunctionDef)}
    release = body["release_memory_occupation"]
    kv = release.index("self.memory_saver_adapter.pause(GPU_MEMORY_TYPE_KV_CACHE)")
    assert release.index("self.flush_cache()", kv) > kv
    # the updater's flush_cache is the scheduler's
    assert "flush_cache=self.flush_cache," in wheel.text("sglang/srt/managers/scheduler.py")
    scheduler = wheel.class_node("sglang/srt/managers/scheduler.py", "Scheduler")
    flush = next(n for n in scheduler.body if isinstance(n, ast.FunctionDef) and n.name == "flush_cache")
    assert ast.unparse(flush.args) == "self, empty_cache: bool=True"
    assert "current_platform.empty_cache()" in ast.unparse(flush)


def test_bucket_payload_is_what_sglang_decodes(wheel):
    path = "sglang/srt/weight_sync/tensor_bucket.py"
    assert wheel.dataclass_fields(path, "FlattenedTensorMetadata") == list(BucketEntry.__dataclass_fields__)
    allowed = wheel.safe_unpickler_globals()
    assert ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata") in allowed
    rebuild = ast.unparse(wheel.class_node(path, "FlattenedTensorBucket"))
    assert ".view(meta.dtype)" in rebuild and ".reshape(meta.shape)" in rebuild


# -- the engine factory's call sites bind to the classes' real signatures ----------------------
def _calls(name: str):
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func).split(".")[-1] == name:
                yield path.relative_to(ROOT), node


def _dummy(node: ast.Call) -> tuple[list, dict]:
    assert all(k.arg is not None for k in node.keywords), "**kwargs at a factory call site"
    return [object()] * len(node.args), {k.arg: object() for k in node.keywords}


def test_engine_factory_call_sites_bind():
    sites = 0
    for where, node in _calls("build_rollout_engine"):
        if where.name == "factory.py":
            continue
        args, kwargs = _dummy(node)
        inspect.signature(build_rollout_engine).bind(*args, **kwargs)
        sites += 1
    for where, node in _calls("make_rollout_engine"):
        args, kwargs = _dummy(node)
        for name in ENGINES:  # the name comes from the recipe: every engine must bind
            try:
                inspect.signature(engine_class(name)).bind(*args[1:], **kwargs)
            except TypeError as err:
                raise AssertionError(f"{where}:{node.lineno}: {name} engine: {err}") from None
        sites += 1
    assert sites >= 1  # the actor worker's
    spec = get_model_spec("tiny-llama")
    push = object()  # the transition's planned push (Resharder.push_plan), handed through
    for name in ENGINES:
        kwargs = engine_kwargs(
            RolloutConfig(engine=name, sglang=SGLangConfig(bucket_mb=64)),
            spec=spec, group=None, control_group=None, pad_token_id=3, model_path="/hf", device="cuda:1",
            push_plan=push,
        )  # fmt: skip
        bound = inspect.signature(engine_class(name)).bind(**kwargs)
        assert bound.arguments["pad_token_id"] == 3
    assert kwargs["base_gpu_id"] == 1 and kwargs["push_plan"] is push and "control_group" in kwargs
    assert kwargs["max_total_tokens"] is None  # "plan" unresolved: SGLang sizes its own pool
    fixed = RolloutConfig(engine="sglang", sglang=SGLangConfig(max_total_tokens=5000))
    assert engine_kwargs(fixed, spec=spec, model_path="/hf")["max_total_tokens"] == 5000


def test_engine_factory_refuses_before_launch():
    spec = get_model_spec("tiny-llama")
    for name in ENGINES:
        with pytest.raises(ValueError, match="rollout.p_g=2"):
            engine_kwargs(RolloutConfig(engine=name, p_g=2), spec=spec, model_path="/hf")
    with pytest.raises(ValueError, match="model.hf_path"):
        engine_kwargs(RolloutConfig(engine="sglang"), spec=spec)


# -- pins ------------------------------------------------------------------------------------
def _pin(requirements: list[str], name: str) -> str:
    for text in requirements:
        req = Requirement(text)
        if req.name.replace("_", "-") == name and not req.marker:
            (spec,) = req.specifier
            assert spec.operator == "==", text
            return spec.version
    raise AssertionError(f"sglang pins no {name}")


def test_pins_agree_with_setup_and_makefile(wheel):
    requires = wheel.requires()
    torch_pin = _pin(requires, "torch")
    setup = (ROOT / "setup.py").read_text()
    assert re.findall(r'"torch==([^"]+)"', setup) == [torch_pin], "setup.py's [gpu] torch pin"
    assert re.findall(r'"sglang==([^"]+)"', setup) == [SGLANG_VERSION]
    extra = re.search(r'"gpu": \[([^\]]*)\]', setup).group(1)
    assert {"GPU_TORCH", "SGLANG"} <= set(re.findall(r"[A-Z_]+", extra))
    transformers = re.search(r'"(transformers[^"]*)"', setup).group(1)
    assert Requirement(transformers).specifier.contains(_pin(requires, "transformers"))
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^GPU_TORCH_SPEC \?= torch==(\S+)", makefile, re.M).group(1) == torch_pin
    for line in makefile.splitlines():  # every torch the Makefile suggests for CUDA
        if "download.pytorch.org/whl/cu" in line:
            assert re.findall(r"torch==([0-9.]+)", line) == [torch_pin], line
    assert re.search(r"^install-gpu:", makefile, re.M)
    assert "$(GPU_TORCH_SPEC)" in makefile and "--no-build-isolation" in makefile
    # CUDA 13 builds of SGLang's kernels: the Transformer Engine extra follows
    assert any(r.startswith("flashinfer_python[cu13]") for r in requires)
    assert "core_cu13" in setup


def test_gpu_docs_name_the_pins(wheel):
    gpu_doc = Path(ROOT / "docs" / "gpu.md").read_text()
    section = gpu_doc.split("## Install on a CUDA machine")[1].split("\n## ")[0]
    assert f"sglang=={SGLANG_VERSION}" in section and "make install-gpu" in section
    assert f"torch=={_pin(wheel.requires(), 'torch')}" in section
