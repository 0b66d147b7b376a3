"""On-policy distillation end to end: a teacher exported from a demo run (`rl3d export`) scores
the student's samples through the `teacher` role. With the student starting from the teacher's
own weights (fp32, same layout) the teacher's log-probs are the student's, bit for bit: the
reverse KL and every advantage are exactly 0."""

import pytest
from test_hf_export import export
from train_helpers import GRPO, metrics_by_step, run_train

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_a_teacher_equal_to_the_student_gives_zero_reverse_kl(tmp_path):
    trained = run_train(
        GRPO, tmp_path / "t", "trainer.total_steps=2", "checkpoint.save_every=2", "model.dtype=float32"
    )
    assert trained.returncode == 0, trained.stderr[-3000:]
    teacher = export(tmp_path / "t", tmp_path / "teacher")
    proc = run_train(
        GRPO,
        tmp_path / "s",
        "trainer.total_steps=2",
        "checkpoint.save_every=0",
        "model.dtype=float32",
        "model.name=null",
        f"model.hf_path={teacher}",
        "algorithm.adv_estimator=on_policy_distillation",
        f"algorithm.distill.teacher={teacher}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = metrics_by_step(tmp_path / "s")
    first = steps[1]
    assert first["distill/reverse_kl"] == 0.0
    assert first["adv/mean"] == 0.0 and first["adv/std"] == 0.0
    assert first["time/teacher_logp"] > 0
