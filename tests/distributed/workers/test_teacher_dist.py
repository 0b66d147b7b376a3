"""The distillation teacher (`rl3d.workers.teacher.TeacherWorker`) on gloo ranks, fp32:
- with a teacher per `data_source`, each teacher runs its forward on its own rows only, and the
  result is each teacher scoring the whole batch with every row keeping its own teacher's;
- its log-probs agree within 1e-6 at tp 1, tp 2 and pp 2, padded and packed;
- a teacher named by an rl3d run directory (the actor's dist checkpoint, saved at tp 2, no
  `rl3d export`) gives the log-probs of the HF directory it was saved from, at tp 1 and tp 2."""

import json

import pytest
import torch

from rl3d.testing.spawn import run_distributed

pytestmark = pytest.mark.distributed

RECIPE = "recipes/quickstart_cpu_grpo.yaml"
B, P, R = 6, 7, 5
TOL = 1e-6
SOURCES = ["math", "code", "math", "other", "code", "math"]  # "other": no teacher of its own


def _batch(vocab_size):
    from rl3d.single_controller.batch import DataBatch

    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(3, vocab_size, (B, P + R), generator=gen)
    mask = torch.ones(B, P + R, dtype=torch.long)
    mask[:3, :2] = 0  # left-padded prompts
    mask[4, P + 3 :] = 0  # a response that stopped early
    tensors = {"input_ids": ids, "attention_mask": mask, "responses": ids[:, P:]}
    tensors["response_mask"] = mask[:, P:].clone()
    return DataBatch(tensors, {"data_source": list(SOURCES)})


def _teacher(groups, student, teacher, by_source=None, extra=()):
    from rl3d.config import load_config
    from rl3d.models.spec import spec_of
    from rl3d.workers.context import RoleContext
    from rl3d.workers.teacher import TeacherWorker

    lay = groups.layout
    overrides = [
        f"model.hf_path={student}",
        "model.dtype=float32",
        f"actor.parallel={{pp: {lay.p}, tp: {lay.t}, dp: 1}}",
        f"launch.nproc_per_node={lay.p * lay.t}",
        f"rollout.t_g={lay.t}",
        "algorithm.adv_estimator=on_policy_distillation",
        f"algorithm.distill.teacher={teacher}",
        *([f"algorithm.distill.teachers_by_source={json.dumps(by_source)}"] if by_source else []),
        *extra,
    ]
    cfg = load_config(RECIPE, overrides).config
    return TeacherWorker(RoleContext(cfg, spec_of(cfg.model), groups, tokenizer=None))


def _logp(worker, batch):
    out = worker.compute_teacher_log_prob(batch)
    return None if out is None else out["teacher_logp"] * batch["response_mask"]


def _save_run(groups, hf_dir, run_dir):
    """An rl3d run directory whose step 1 holds `hf_dir`'s weights as the actor's dist checkpoint."""
    from rl3d.engine import InitialWeights, MegatronEngine
    from rl3d.models.dist_checkpoint import save_checkpoint
    from rl3d.models.spec import spec_in_dir

    spec = spec_in_dir(hf_dir)
    role = MegatronEngine(
        spec,
        groups,
        role="actor",
        params_dtype=torch.float32,
        seed=1,
        weights=InitialWeights(hf_path=hf_dir),
    )
    step = run_dir / "checkpoints" / "step_1"
    save_checkpoint(step / "actor", ddp=role.ddp, optimizer=None, scheduler=None, groups=groups, iteration=1)
    if groups.rank == 0:
        (run_dir / "resolved_config.yaml").write_text(f"model:\n  hf_path: {hf_dir}\n  dtype: float32\n")
        (step / "meta.json").write_text(json.dumps({"step": 1}))
    torch.distributed.barrier()


def worker(rank, world, pp, tp, dirs, save_run):
    from pathlib import Path

    from rl3d.models.bootstrap import destroy_megatron, init_megatron
    from rl3d.parallel.layout import ParallelLayout

    a, b, run_dir = Path(dirs["a"]), Path(dirs["b"]), Path(dirs["run"])
    groups = init_megatron(ParallelLayout(pp, tp, 1), seed=1)
    if save_run:
        _save_run(groups, a, run_dir)
    two = _teacher(groups, a, a, by_source={"code": str(b)})
    from rl3d.models.spec import spec_in_dir

    batch = _batch(spec_in_dir(a).vocab_size)
    out = {"by_source": _logp(two, batch), "rows": {Path(k).name: v for k, v in two.rows_scored.items()}}
    # every teacher on the whole batch, then each row's own
    full = {Path(p).name: two._logprobs(spec, role, batch) for p, (spec, role) in two.teachers.items()}
    if full["a"] is not None:
        rows_b = torch.tensor([s == "code" for s in SOURCES])[:, None]
        out["selected"] = torch.where(rows_b, full["b"], full["a"]) * batch["response_mask"]
    packed = ["actor.packing=true", "actor.max_tokens_per_micro_batch=24"]
    out["packed"] = _logp(_teacher(groups, a, a, by_source={"code": str(b)}, extra=packed), batch)
    out["checkpoint"] = _logp(_teacher(groups, a, run_dir), batch)
    out["hf_a"] = _logp(_teacher(groups, a, a), batch)
    destroy_megatron()
    return out


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    from rl3d.testing.tiny_hf import save_tiny_hf_model

    root = tmp_path_factory.mktemp("teachers")
    save_tiny_hf_model("tiny-llama", root / "a", seed=3)
    save_tiny_hf_model("tiny-llama", root / "b", seed=4)
    return {"a": str(root / "a"), "b": str(root / "b"), "run": str(root / "run")}


def _close(x, y):
    return (x - y).abs().max().item() <= TOL


@pytest.mark.slow  # three gloo worlds of megatron roles: about a minute at load 2
def test_teacher_rows_layouts_packing_and_checkpoint(dirs):
    tp2 = run_distributed(worker, 2, 1, 2, dirs, True, timeout_s=300)  # saves the run at tp 2
    (tp1,) = run_distributed(worker, 1, 1, 1, dirs, False, timeout_s=300)
    pp2 = run_distributed(worker, 2, 2, 1, dirs, False, timeout_s=300)
    # each teacher saw its rows only: "code" rows to b, the rest (math, other) to a
    assert tp1["rows"] == {"a": 4, "b": 2}
    assert _close(tp1["by_source"], tp1["selected"])
    assert tp1["by_source"].abs().sum() > 0 and not _close(tp1["hf_a"], tp1["by_source"])  # b matters
    assert _close(tp1["packed"], tp1["by_source"])
    assert pp2[0]["by_source"] is None  # the first stage has no log-probs
    for got in (tp2[0], tp2[1], pp2[1]):
        for key in ("by_source", "packed", "checkpoint", "hf_a"):
            assert _close(got[key], tp1[key]), key
    # the run directory's checkpoint (saved at tp 2) is the HF teacher it was saved from
    assert _close(tp1["checkpoint"], tp1["hf_a"]) and _close(tp2[0]["checkpoint"], tp2[0]["hf_a"])
