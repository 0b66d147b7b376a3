"""On-policy distillation end to end: a teacher from a demo run scores the student's samples
through the `teacher` role. With the student starting from the teacher's own weights (fp32) the
teacher's log-probs are the student's: the reverse KL and every advantage are 0 at step 1,
whether the teacher is the run's `rl3d export` (colocated, the actor's layout) or the run
directory itself (its checkpoint read without an export) on its own pool of 2 ranks at tp 2."""

import pytest
from test_hf_export import export
from train_helpers import GRPO, metrics_by_step, run_train

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
STUDENT = ("trainer.total_steps=2", "checkpoint.save_every=0", "model.dtype=float32", "model.name=null")
DISTILL = ("algorithm.adv_estimator=on_policy_distillation",)


@pytest.fixture(scope="module")
def teacher_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("teacher")
    trained = run_train(
        GRPO, root / "t", "trainer.total_steps=2", "checkpoint.save_every=2", "model.dtype=float32"
    )
    assert trained.returncode == 0, trained.stderr[-3000:]
    return root / "t", export(root / "t", root / "teacher")


def test_a_teacher_equal_to_the_student_gives_zero_reverse_kl(teacher_run, tmp_path):
    _, teacher = teacher_run
    proc = run_train(
        GRPO,
        tmp_path / "s",
        *STUDENT,
        f"model.hf_path={teacher}",
        *DISTILL,
        f"algorithm.distill.teacher={teacher}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    first = metrics_by_step(tmp_path / "s")[1]
    assert first["distill/reverse_kl"] == 0.0
    assert first["adv/mean"] == 0.0 and first["adv/std"] == 0.0
    assert first["time/teacher_logp"] > 0


def test_a_run_directory_teaches_from_its_own_pool_at_tp2(teacher_run, tmp_path):
    run_dir, exported = teacher_run
    proc = run_train(
        GRPO,
        tmp_path / "s",
        *STUDENT,
        f"model.hf_path={exported}",
        *DISTILL,
        f"algorithm.distill.teacher={run_dir}",  # the checkpoint itself, no export
        "algorithm.distill.colocate=false",
        "algorithm.distill.parallel={tp: 2, pp: 1, dp: 1}",
        "launch.nproc_per_node=4",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    first = metrics_by_step(tmp_path / "s")[1]
    assert abs(first["distill/reverse_kl"]) <= 1e-6  # another world, the same weights and layout
    assert abs(first["adv/mean"]) <= 1e-6 and first["time/teacher_logp"] > 0
