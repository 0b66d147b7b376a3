"""SGLang's control messages (the barrier after its launch, the gather of IPC handles, the
broadcast of generated rows) go over the gloo twin of the generation-TP group, which waits
`launch.timeout_s`, not over the generation-TP group itself (NCCL on a GPU, waiting
`hybrid_engine.timeout_s`). Two gloo ranks, t_g = 2, the SGLang stand-in (tests/unit/rollout)
taking longer to launch and to generate than the generation-TP group's 2 s timeout: rank 1 waits
for rank 0 through both and gets rank 0's rows. The push before it gathers each parameter over
the group as planned (`reshard/engine_gather_bytes`)."""

import sys
from pathlib import Path

import pytest

from rl3d.testing.spawn import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
ROLLOUT_TESTS = Path(__file__).resolve().parents[2] / "unit" / "rollout"
SLOW_S = 4.0  # SGLang's launch and one generate, longer than hybrid_engine.timeout_s below


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
    from rl3d.single_controller.batch import DataBatch
    from rl3d.workers.context import RoleContext
    from rl3d.workers.roles import ActorRolloutWorker

    overrides = [
        "rollout.engine=sglang", "launch.device=cuda", f"model.hf_path={hf_dir}", "model.dtype=float32",
        "actor.parallel.tp=2", "launch.nproc_per_node=2", "rollout.t_g=2", "rollout.max_new_tokens=4",
        "hybrid_engine.timeout_s=2", "launch.timeout_s=60",
    ]  # fmt: skip
    cfg = load_config("recipes/quickstart_cpu_grpo.yaml", overrides).config
    standin = install(MonkeyPatch(), wheel_or_skip())
    standin.launch_seconds = standin.generate_seconds = SLOW_S
    groups = init_megatron(ParallelLayout(1, 2, 1), seed=1)
    worker = ActorRolloutWorker(RoleContext(cfg, get_model_spec("tiny-llama"), groups, tokenizer=None))
    control = worker.rollout.hybrid_groups.gen_tp_control
    assert control is not None and control.ranks == (0, 1)
    worker.start_engine([])
    assert len(standin.engines) == (1 if rank == 0 else 0)  # group rank 0 launches SGLang
    metrics = worker.reshard()
    # the push, the plan's last step: each rank gathers its peer's shards (checked, then counted)
    plan = worker.rollout.resharder.push_plan
    pushed = [metrics[f"reshard/engine_{k}"] for k in ("gather_bytes", "bytes", "buckets")]
    assert pushed == [plan.gather_bytes, plan.nbytes, len(plan.buckets)] and plan.gather_bytes > 0
    prompts = DataBatch(meta={"prompt_ids": [[3, 1, 4], [1, 5, 9, 2]], "uid": [0, 1]})
    out = worker.generate_sequences(prompts, step=0)
    worker.release_generation()
    return out["responses"].tolist(), torch.distributed.get_backend(control.handle)


def test_control_messages_wait_on_the_gloo_twin(tmp_path):
    sys.path.insert(0, str(ROLLOUT_TESTS))
    from sglang_wheel import wheel_or_skip

    wheel_or_skip()  # downloads it once, or skips saying why
    from rl3d.testing.tiny_hf import save_tiny_hf_model

    save_tiny_hf_model("tiny-llama", tmp_path / "hf", seed=7)
    (r0, backend0), (r1, backend1) = run_distributed(worker, 2, str(tmp_path / "hf"), timeout_s=240)
    assert r0 == r1 and len(r0) == 8  # 2 prompts, rollout.n = 4
    assert backend0 == backend1 == "gloo"
