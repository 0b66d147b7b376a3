"""On-policy distillation's estimator and config: the negative per-token reverse KL as the
advantage, the task reward's GRPO advantage mixed in by `distill.coef`, a teacher required."""

from pathlib import Path

import pytest
import torch

from rl3d import algos
from rl3d.algos.advantages import compute_advantages
from rl3d.config import AlgorithmConfig
from rl3d.config.distill import DistillConfig
from rl3d.config.errors import FieldError

MASK = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
LOGP = torch.tensor([[-1.0, -2.0, 9.0], [-0.5, -0.5, -3.0]])
TEACHER = torch.tensor([[-1.5, -1.0, -9.0], [-0.5, -2.5, -1.0]])


def test_advantage_is_the_negative_reverse_kl_per_token():
    rewards = torch.zeros(2, 3)
    adv = compute_advantages(
        "on_policy_distillation", rewards_BT=rewards, mask_BT=MASK, logp_BT=LOGP, teacher_logp_BT=TEACHER
    )
    # teacher - student where valid, 0 at padding
    torch.testing.assert_close(adv.adv_BT, torch.tensor([[-0.5, 1.0, 0.0], [0.0, -2.0, 2.0]]))
    torch.testing.assert_close(adv.returns_BT, adv.adv_BT)
    kl = algos.distill.reverse_kl_by_token(LOGP, TEACHER, MASK)
    assert kl.item() == pytest.approx((0.5 - 1.0 + 0.0 + 2.0 - 2.0) / 5)


def test_the_task_reward_mixes_in_with_its_coefficient():
    scores = torch.tensor([1.0, 0.0])
    rewards = algos.scores_to_token_rewards(scores, MASK)
    uids = torch.tensor([7, 7])
    grpo = algos.grpo_advantages(rewards_BT=rewards, mask_BT=MASK, group_ids_B=uids).adv_BT
    mixed = compute_advantages(
        "on_policy_distillation",
        rewards_BT=rewards,
        mask_BT=MASK,
        logp_BT=LOGP,
        teacher_logp_BT=TEACHER,
        group_ids_B=uids,
        task_coef=0.5,
    )
    pure = compute_advantages(
        "on_policy_distillation", rewards_BT=rewards, mask_BT=MASK, logp_BT=LOGP, teacher_logp_BT=TEACHER
    )
    torch.testing.assert_close(mixed.adv_BT, pure.adv_BT + 0.5 * grpo)


def test_a_missing_teacher_input_is_an_error():
    with pytest.raises(ValueError, match="needs teacher_logp_BT"):
        compute_advantages("on_policy_distillation", rewards_BT=torch.zeros(2, 3), mask_BT=MASK, logp_BT=LOGP)


def test_config_requires_a_teacher_and_refuses_one_elsewhere():
    with pytest.raises(FieldError) as info:
        AlgorithmConfig(adv_estimator="on_policy_distillation")
    assert info.value.field == "distill.teacher"
    with pytest.raises(FieldError, match="takes no teacher"):
        AlgorithmConfig(adv_estimator="grpo", distill=DistillConfig(teacher="/x"))
    with pytest.raises(FieldError, match="coef: must be >= 0"):
        DistillConfig(teacher="/x", coef=-1.0)
    cfg = AlgorithmConfig(
        adv_estimator="on_policy_distillation",
        distill=DistillConfig(teacher="/a", teachers_by_source={"math": "/b", "code": "/a"}),
    )
    assert cfg.family.needs_teacher and cfg.distill.paths() == ["/a", "/b"]
    assert [cfg.distill.teacher_for(s) for s in ("math", "code", "other", None)] == ["/b", "/a", "/a", "/a"]


GRPO = Path(__file__).resolve().parents[3] / "recipes/quickstart_cpu_grpo.yaml"
DISTILL = ["algorithm.adv_estimator=on_policy_distillation", "algorithm.distill.teacher=/t"]


def test_teachers_colocated_or_on_their_own_pool_in_their_own_layout():
    from rl3d.config import ConfigError, load_config
    from rl3d.config.pools import role_pools

    colocated = load_config(GRPO, DISTILL).config
    assert [p.roles for p in role_pools(colocated)] == [("actor", "reference", "teacher")]
    own = [*DISTILL, "algorithm.distill.colocate=false", "algorithm.distill.parallel={tp: 2, pp: 1, dp: 1}"]
    pools = role_pools(load_config(GRPO, [*own, "launch.nproc_per_node=4"]).config)
    teacher = pools[1]
    assert (teacher.name, list(teacher.ranks), teacher.roles) == ("teacher", [2, 3], ("teacher",))
    assert (teacher.layout.t, teacher.layout.p, teacher.layout.d) == (2, 1, 1)
    with pytest.raises(
        ConfigError, match=r"algorithm\.distill\.parallel: colocated teachers use the actor's"
    ):
        load_config(GRPO, [*DISTILL, "algorithm.distill.parallel={tp: 1, pp: 1, dp: 2}"])
    with pytest.raises(FieldError, match="parallel: teachers in their own pool"):
        DistillConfig(teacher="/x", colocate=False)


def _run_dir(root, steps, complete=True):
    root.mkdir()
    (root / "resolved_config.yaml").write_text("model:\n  name: tiny-llama\n  dtype: float32\n")
    for step in steps:
        (root / "checkpoints" / f"step_{step}" / "actor").mkdir(parents=True)
        if complete:
            (root / "checkpoints" / f"step_{step}" / "meta.json").write_text("{}")
    return root


def test_a_teacher_path_names_a_run_its_step_or_an_hf_directory(tmp_path):
    from rl3d.config.run_dir import checkpoint_teacher

    run = _run_dir(tmp_path / "run", [2, 10])
    model, actor = checkpoint_teacher(run)
    assert model.name == "tiny-llama" and actor == run / "checkpoints/step_10/actor"  # the newest
    assert checkpoint_teacher(run / "checkpoints/step_2")[1] == run / "checkpoints/step_2/actor"
    (tmp_path / "hf").mkdir()
    assert checkpoint_teacher(tmp_path / "hf") is None  # HF directories load as before
    half = _run_dir(tmp_path / "half", [3], complete=False)
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        checkpoint_teacher(half)
    with pytest.raises(FileNotFoundError, match="incomplete checkpoint"):
        checkpoint_teacher(half / "checkpoints/step_3")


def test_preflight_names_a_missing_or_mismatched_teacher(tmp_path):
    from rl3d.config import load_config
    from rl3d.config.errors import ConfigError
    from rl3d.config.run_dir import preflight_teachers
    from rl3d.testing.tiny_hf import save_tiny_hf_model

    def fail(key, message):
        return ConfigError(message, key=key)

    save_tiny_hf_model("tiny-llama", tmp_path / "hf")
    cfg = load_config(GRPO, [DISTILL[0], f"algorithm.distill.teacher={tmp_path / 'hf'}"]).config
    preflight_teachers(cfg, fail)  # the student's vocabulary, the actor's layout fits it
    half = _run_dir(tmp_path / "run", [1], complete=False)
    cfg = load_config(GRPO, [DISTILL[0], f"algorithm.distill.teacher={half}"]).config
    with pytest.raises(ConfigError, match=r"algorithm\.distill\.teacher: .*no complete checkpoint"):
        preflight_teachers(cfg, fail)
    save_tiny_hf_model("tiny-qwen2", tmp_path / "qwen")  # 2 KV heads: the student's tp=4 fits 4
    wide = [DISTILL[0], f"algorithm.distill.teacher={tmp_path / 'qwen'}", "actor.parallel.tp=4"]
    cfg = load_config(GRPO, [*wide, "launch.nproc_per_node=4", "rollout.t_g=1"]).config
    with pytest.raises(ConfigError, match=r"actor\.parallel\.tp: tp=4 must divide teacher .* 2 KV heads"):
        preflight_teachers(cfg, fail)
