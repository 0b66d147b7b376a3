"""The adapter transition into SGLang at generation TP 2: each rank holds its generation-TP
shards of the adapters (lora_B of q/v split by rows, lora_A of down_proj by columns), and
`load_lora` gathers them whole over the group; SGLang on rank 0 gets exactly the actor's PEFT
state dict. Two gloo ranks, the SGLang stand-in (tests/unit/rollout)."""

import sys
from pathlib import Path

import pytest

from rl3d.testing.spawn import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
ROLLOUT_TESTS = Path(__file__).resolve().parents[2] / "unit" / "rollout"


def worker(rank, world, hf_dir):
    import torch
    from _pytest.monkeypatch import MonkeyPatch

    sys.path.insert(0, str(ROLLOUT_TESTS))
    from sglang_standin import install
    from sglang_wheel import wheel_or_skip

    from rl3d.config import load_config
    from rl3d.models.bootstrap import init_megatron
    from rl3d.models.spec import get_model_spec
    from rl3d.parallel.layout import ParallelLayout
    from rl3d.workers.context import RoleContext
    from rl3d.workers.roles import ActorRolloutWorker

    overrides = [
        "rollout.engine=sglang", "launch.device=cuda", f"model.hf_path={hf_dir}", "model.dtype=float32",
        "actor.parallel.tp=2", "launch.nproc_per_node=2", "rollout.t_g=2", "launch.timeout_s=60",
        "actor.packing=false", "actor.lora.rank=4", "actor.lora.target_modules=[q_proj,v_proj,down_proj]",
        "actor.lora.transition=adapters",
    ]  # fmt: skip
    cfg = load_config("recipes/quickstart_cpu_grpo.yaml", overrides).config
    standin = install(MonkeyPatch(), wheel_or_skip())
    groups = init_megatron(ParallelLayout(1, 2, 1), seed=1)
    worker = ActorRolloutWorker(RoleContext(cfg, get_model_spec("tiny-llama"), groups, tokenizer=None))
    worker.start_engine([])
    with torch.no_grad():  # B starts at zero: make every factor tell its shards apart
        for t in worker.role.adapter_shards().values():
            t.copy_(torch.randn_like(t))
    loaded = []
    if rank == 0:
        (engine,) = standin.engines
        load = engine.load_lora_adapter_from_tensors

        def recorded(lora_name, tensors, config_dict, load_format=None):
            loaded.append({k: v.clone() for k, v in tensors.items()})
            return load(lora_name, tensors, config_dict, load_format)

        engine.load_lora_adapter_from_tensors = recorded
    worker.reshard()
    want = worker.role.lora_state_dict()  # collective: gathered over TP by the actor itself
    if rank == 1:
        return None
    (got,) = loaded
    assert sorted(got) == sorted(want)
    return [name for name, value in want.items() if not torch.equal(got[name], value)]


def test_adapters_gathered_whole_for_sglang(tmp_path):
    sys.path.insert(0, str(ROLLOUT_TESTS))
    from sglang_wheel import wheel_or_skip

    wheel_or_skip()
    from rl3d.testing.tiny_hf import save_tiny_hf_model

    save_tiny_hf_model("tiny-llama", tmp_path / "hf", seed=7)
    differ, _ = run_distributed(worker, 2, str(tmp_path / "hf"), timeout_s=240)
    assert differ == []
