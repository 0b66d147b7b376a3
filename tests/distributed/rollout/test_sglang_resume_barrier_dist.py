"""SGLang resumes a memory tag on every GPU of the generation-TP group at once, so no rank may
still hold freed blocks in its allocator's cache when group rank 0 asks for it: before each
resume (the weights in `load_weights`, the KV cache in `resume_memory`) every rank empties its
cache and the group meets at a barrier. Two gloo ranks, t_g = 2, the SGLang stand-in
(tests/unit/rollout): rank 1 empties its cache slowly; each resume SGLang sees on rank 0 must
come after rank 1's empty cache of the same round."""

import sys
import time
from pathlib import Path

import pytest

from rl3d.testing.spawn import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
ROLLOUT_TESTS = Path(__file__).resolve().parents[2] / "unit" / "rollout"
SLOW_EMPTY_S = 1.5  # rank 1's empty cache; rank 0 would resume meanwhile without the barrier


def worker(rank, world, hf_dir, marks):
    from _pytest.monkeypatch import MonkeyPatch

    sys.path.insert(0, str(ROLLOUT_TESTS))
    from sglang_standin import install
    from sglang_wheel import wheel_or_skip

    import rl3d.rollout.sglang_engine as sglang_engine
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
        "launch.timeout_s=60",
    ]  # fmt: skip
    cfg = load_config("recipes/quickstart_cpu_grpo.yaml", overrides).config
    patch = MonkeyPatch()
    standin = install(patch, wheel_or_skip())
    emptied = []

    def empty_cache():  # rank 1's takes a while; each round leaves a mark rank 0 can see
        if rank == 1:
            time.sleep(SLOW_EMPTY_S)
            emptied.append(len(emptied))
            (Path(marks) / f"emptied-{len(emptied)}").touch()

    patch.setattr(sglang_engine, "_empty_allocator_cache", empty_cache)
    groups = init_megatron(ParallelLayout(1, 2, 1), seed=1)
    worker = ActorRolloutWorker(RoleContext(cfg, get_model_spec("tiny-llama"), groups, tokenizer=None))
    worker.start_engine([])
    seen = []  # per resume SGLang saw on rank 0: its tags, and how many rounds rank 1 had emptied
    if rank == 0:
        (engine,) = standin.engines
        resume = engine.resume_memory_occupation

        def recorded(tags=None):
            seen.append((tuple(tags), len(list(Path(marks).glob("emptied-*")))))
            return resume(tags)

        engine.resume_memory_occupation = recorded
    worker.reshard()
    worker.generate_sequences(DataBatch(meta={"prompt_ids": [[3, 1, 4]], "uid": [0]}), step=0)
    worker.release_generation()
    return seen


def test_every_rank_empties_its_cache_before_sglang_resumes(tmp_path):
    sys.path.insert(0, str(ROLLOUT_TESTS))
    from sglang_wheel import wheel_or_skip

    wheel_or_skip()  # downloads it once, or skips saying why
    from rl3d.testing.tiny_hf import save_tiny_hf_model

    save_tiny_hf_model("tiny-llama", tmp_path / "hf", seed=7)
    (tmp_path / "marks").mkdir()
    seen, _ = run_distributed(worker, 2, str(tmp_path / "hf"), str(tmp_path / "marks"), timeout_s=240)
    # the weights (load_weights), then the KV cache and CUDA graphs (resume_memory): each after
    # rank 1 emptied its cache for that round
    expected = [({"weights"}, 1), ({"kv_cache", "cuda_graph"}, 2)]
    assert [(set(tags), rounds) for tags, rounds in seen] == expected
