"""Two steps of the actor worker's reshard / generate / release cycle with `rollout.engine: sglang`
on CPU, against a stand-in SGLang whose behaviour follows the pinned wheel's source
(`sglang_standin`), started under torchrun's environment. Skipped, saying why, where the wheel
cannot be downloaded."""

import math
import multiprocessing
import os
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from sglang_standin import install, raw_logprob
from sglang_wheel import wheel_or_skip

from rl3d.config import load_config
from rl3d.rollout import SamplingParams
from rl3d.rollout.sglang_launch import SGLangSchedulerError
from rl3d.rollout.sglang_weights import SGLANG_CHILD_ENV, TORCHRUN_VARS
from rl3d.single_controller.batch import DataBatch

ROOT = Path(__file__).resolve().parents[3]
TORCHRUN_ENV = {
    "TORCHELASTIC_USE_AGENT_STORE": "True",
    "TORCHELASTIC_RUN_ID": "none",
    "TORCHELASTIC_RESTART_COUNT": "0",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29511",
    "RANK": "0",
    "LOCAL_RANK": "0",
    "WORLD_SIZE": "1",
    "CUDA_DEVICE_MAX_CONNECTIONS": "1",  # what megatron asks for; SGLang writes 8
}
PROMPTS = [[3, 1, 4], [1, 5, 9, 2], [6, 5, 3, 5, 8]]


def _hf_state(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


def test_actor_two_steps_on_the_sglang_standin(groups, tmp_path, monkeypatch, sigquit_restored):
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
        "rollout.temperature=0.7", "rollout.sglang.deterministic=true", "rollout.sglang.bucket_mb=0.02",
    ]  # fmt: skip
    cfg = load_config(ROOT / "recipes/quickstart_cpu_grpo.yaml", overrides).config
    for name, value in TORCHRUN_ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("NCCL_CUMEM_ENABLE", raising=False)
    standin = install(monkeypatch, wheel)
    parent_env, start_method = dict(os.environ), multiprocessing.get_start_method(allow_none=True)

    worker = ActorRolloutWorker(RoleContext(cfg, get_model_spec("tiny-llama"), groups, tokenizer=None))
    assert not standin.engines  # launched once every colocated role exists
    worker.start_engine([])

    (engine,) = standin.engines
    # launch: the scheduler's environment, and rank 0's own given back
    assert not {k for k in engine.child_env if k in TORCHRUN_VARS or k.startswith("TORCHELASTIC_")}
    assert engine.child_env["CUDA_DEVICE_MAX_CONNECTIONS"] == "8" and engine.original_logprob
    assert all(engine.child_env[k] == v for k, v in SGLANG_CHILD_ENV.items())
    for name in {*standin.env_writes, *TORCHRUN_ENV, *SGLANG_CHILD_ENV}:  # rank 0 runs what its peers run
        assert os.environ.get(name) == parent_env.get(name), name
    assert multiprocessing.get_start_method(allow_none=True) == start_method
    record = worker.rollout.engine.launch_env
    assert set(record["set_by_sglang"]) == set(standin.env_writes)
    assert set(record["scrubbed"]) == {k for k in TORCHRUN_ENV if k != "CUDA_DEVICE_MAX_CONNECTIONS"}
    assert engine.args["skip_tokenizer_init"] and engine.args["enable_deterministic_inference"]
    assert engine.args["mem_fraction_static"] == cfg.rollout.sglang.mem_fraction_static
    assert engine.args["load_format"] == "dummy" and not engine.read_checkpoint
    # SGLang's SIGQUIT handler is gone: a failed scheduler raises rl3d's error in the trainer
    assert record["signal_handlers_restored"] == ["SIGQUIT"]
    with pytest.raises(SGLangSchedulerError, match="scheduler process failed"):
        signal.raise_signal(signal.SIGQUIT)
    # nothing held while the other roles are built
    assert engine.offload_tags == set(standin.memory_types)

    expected = _hf_state(hf)
    prompts = DataBatch(meta={"prompt_ids": PROMPTS, "uid": [10, 11, 12]})
    batches = []
    for step in range(2):
        if step == 1:  # an "update": every actor parameter moves
            with torch.no_grad():
                for t in worker.role.global_shards().values():
                    t.add_(0.25)
            expected = {k: v + 0.25 for k, v in expected.items()}
        engine.events.clear()
        engine.pushed.clear()
        metrics = worker.reshard()
        # the push is the plan's last step: exactly the planned buckets, counted in reshard/*
        plan = worker.rollout.resharder.push_plan
        assert engine.pushed == [(b.names, b.nbytes) for b in plan.buckets] and len(plan.buckets) > 1
        assert metrics["reshard/engine_bytes"] == plan.nbytes == sum(t.numel() * 4 for t in expected.values())
        assert metrics["reshard/engine_buckets"] == len(plan.buckets)
        assert metrics["reshard/engine_gather_bytes"] == 0 and metrics["reshard/engine_seconds"] > 0
        assert worker.rollout.weights is None  # the resharded copy is freed once SGLang holds the weights
        assert engine.offload_tags == {"kv_cache", "cuda_graph"}  # resumed by the first generation
        assert set(engine.weights) == set(expected)
        for name, value in engine.weights.items():
            assert torch.allclose(value, expected[name], atol=1e-6), name
        out = worker.generate_sequences(prompts, step=step)
        worker.release_generation()
        kinds = [e[0] for e in engine.events]
        assert kinds[:2] == ["resume", "begin"] and engine.events[0] == ("resume", ("weights",))
        updates = kinds.count("update")
        assert updates >= 1 and kinds[2 : 2 + updates] == ["update"] * updates
        assert kinds[2 + updates :] == ["end", "resume", "flush", "generate", "release"]
        assert set(engine.events[3 + updates][1]) == {"kv_cache", "cuda_graph"}
        assert engine.events[-1] == ("release", tuple(standin.memory_types))
        # raw log-probs at T = 0.7; no stop ids: SGLang must not stop at the EOS it sampled
        resp, mask = out["responses"], out["response_mask"].bool()
        expect_lp = torch.tensor([[raw_logprob(t) for t in row] for row in resp.tolist()])
        assert torch.allclose(out["rollout_logp"][mask], expect_lp[mask])
        assert out.meta["finish_reason"] == ["length"] * 6 and mask.all()
        assert resp[:2, 1].tolist() == [2, 2]  # the n = 2 samples of the even-sum prompt sampled EOS (id 2)
        batches.append(resp)
    assert not torch.equal(batches[0], batches[1])  # new weights, new seed
    assert standin.patched_reductions >= 2  # device UUIDs in the IPC payloads

    # released: generation refuses, on the adapter and on SGLang's side alike
    with pytest.raises(RuntimeError, match="released"):
        worker.rollout.engine.generate(PROMPTS, SamplingParams(max_new_tokens=2))
    with pytest.raises(RuntimeError, match="released"):
        engine.generate(input_ids=PROMPTS, sampling_params=[{"max_new_tokens": 2}] * 3)
    with pytest.raises(KeyError):  # resuming what was not released (the wheel's offload_tags.remove)
        engine.resume_memory_occupation(["kv_cache"])
        engine.resume_memory_occupation(["kv_cache"])
    engine.offload_tags.add("kv_cache")

    # a checkpoint pauses generation: the KV cache goes, the weights stay
    worker.reshard()
    worker.generate_sequences(prompts, step=2)
    worker.pause_generation()
    assert engine.offload_tags == {"kv_cache", "cuda_graph"} and not math.isnan(engine.checksum())
    worker.generate_sequences(prompts, step=2)  # resumes the cache, no new push
    assert [e[0] for e in engine.events[-4:]] == ["release", "resume", "flush", "generate"]

    # stop ids: SGLang stops at them and at the model's EOS, so EOS must be among them
    with pytest.raises(ValueError, match="EOS ids \\[2\\]"):
        worker.rollout.engine.generate(PROMPTS, SamplingParams(max_new_tokens=4, stop_token_ids=(7,)))
    engine = worker.rollout.engine
    again = [engine.generate(PROMPTS, SamplingParams(max_new_tokens=4, stop_token_ids=(2,), seed=5))
             for _ in range(2)]  # fmt: skip
    assert again[0].finish_reasons[0] == "stop" and again[0].responses()[0][-1] == 2
    assert all((r == "stop") == (2 in ids) for r, ids in zip(again[0].finish_reasons, again[0].responses()))
    assert torch.equal(again[0].response_ids, again[1].response_ids)  # seeded: deterministic inference
    assert torch.equal(again[0].raw_logprobs, again[0].logprobs)


def test_the_engine_needs_its_planned_push(monkeypatch):
    from rl3d.models.spec import get_model_spec
    from rl3d.rollout.sglang_engine import SGLangRolloutEngine

    standin = install(monkeypatch, wheel_or_skip())
    with pytest.raises(ValueError, match="pushes the buckets its transition planned: give push_plan"):
        SGLangRolloutEngine(get_model_spec("tiny-llama"), model_path="unused")
    assert not standin.engines  # refused before the launch
