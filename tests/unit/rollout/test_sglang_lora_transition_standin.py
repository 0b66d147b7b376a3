"""`actor.lora.transition: adapters` with `rollout.engine: sglang`, through the actor worker on
the CPU stand-in of the pinned wheel (`sglang_standin`): SGLang is launched with LoRA enabled
and sized and with its weights' CPU backup; the first publish pushes the frozen base (the plan's
push), every later one only resumes it and loads the step's adapters, gathered whole under
PEFT's names, through `load_lora_adapter_from_tensors`. Skipped, saying why, without the wheel."""

from pathlib import Path

import torch
from safetensors.torch import load_file
from sglang_standin import install
from sglang_wheel import wheel_or_skip

from rl3d.config import load_config
from rl3d.single_controller.batch import DataBatch

ROOT = Path(__file__).resolve().parents[3]
TARGETS = ["q_proj", "v_proj", "down_proj"]


def test_the_base_once_then_adapters_into_sglang(groups, tmp_path, monkeypatch, sigquit_restored):
    wheel = wheel_or_skip()
    from rl3d.models.spec import get_model_spec
    from rl3d.testing.tiny_hf import save_tiny_hf_model
    from rl3d.workers.context import RoleContext
    from rl3d.workers.roles import ActorRolloutWorker

    hf = tmp_path / "hf"
    save_tiny_hf_model("tiny-llama", hf, seed=7)
    overrides = [
        "rollout.engine=sglang", "launch.device=cuda", f"model.hf_path={hf}", "model.dtype=float32",
        "actor.parallel.tp=1", "launch.nproc_per_node=1", "rollout.n=2", "rollout.max_new_tokens=4",
        "rollout.sglang.bucket_mb=0.02", "actor.packing=false", "actor.lora.rank=4",
        f"actor.lora.target_modules=[{','.join(TARGETS)}]", "actor.lora.transition=adapters",
    ]  # fmt: skip
    cfg = load_config(ROOT / "recipes/quickstart_cpu_grpo.yaml", overrides).config
    standin = install(monkeypatch, wheel)
    worker = ActorRolloutWorker(RoleContext(cfg, get_model_spec("tiny-llama"), groups, tokenizer=None))
    worker.start_engine([])
    (engine,) = standin.engines
    assert engine.args["enable_lora"] and engine.args["max_lora_rank"] == 4
    assert engine.args["lora_target_modules"] == TARGETS and engine.args["enable_weights_cpu_backup"]
    loaded = []  # the tensors of each adapter SGLang was handed
    load = engine.load_lora_adapter_from_tensors

    def recorded(lora_name, tensors, config_dict, load_format=None):
        loaded.append(({k: v.clone() for k, v in tensors.items()}, config_dict))
        return load(lora_name, tensors, config_dict, load_format)

    engine.load_lora_adapter_from_tensors = recorded
    base = {}
    for file in sorted(hf.glob("*.safetensors")):
        base.update(load_file(str(file)))
    prompts = DataBatch(meta={"prompt_ids": [[3, 1, 4], [1, 5, 9, 2]], "uid": [0, 1]})
    rows = []
    for step in range(2):
        if step == 1:  # an "update": the adapters move, the base stays frozen
            with torch.no_grad():
                for t in worker.role.adapter_shards().values():
                    t.add_(0.25)
        engine.events.clear()
        engine.pushed.clear()
        metrics = worker.reshard()
        kinds = [e[0] for e in engine.events]
        if step == 0:  # the base: the planned push, once
            plan = worker.rollout.resharder.push_plan
            assert engine.pushed == [(b.names, b.nbytes) for b in plan.buckets]
            assert kinds[:2] == ["resume", "begin"] and kinds.count("end") == 1
        else:  # resumed from SGLang's CPU backup, nothing pushed
            assert kinds == ["resume", "unload_lora", "load_lora"] and not engine.pushed
        assert engine.events[0] == ("resume", ("weights",))
        for name, value in engine.weights.items():  # the frozen base, never NaN
            assert torch.equal(value, base[name]), name
        tensors, config = loaded[-1]
        want = worker.role.lora_state_dict()
        assert sorted(tensors) == sorted(want) and len(want) == 2 * len(TARGETS) * 2  # 2 layers
        for name, value in want.items():
            assert torch.equal(tensors[name], value), name
        assert config["r"] == 4 and config["target_modules"] == TARGETS
        assert (
            metrics["reshard/bytes"]
            == worker.rollout.transition.adapter_resharder.last_stats.metrics()["reshard/bytes"]
        )
        out = worker.generate_sequences(prompts, step=step)
        rows.append(out["responses"])
        worker.release_generation()
        assert engine.offload_tags == set(standin.memory_types)  # nothing held through training
    assert list(engine.loras) == ["rl3d-lora-2"]  # one adapter at a time
    assert not torch.equal(rows[0], rows[1])
