"""`rollout.agent` end to end: real torchrun, megatron actor at dp=2, an openai-client agent whose
sessions give more rows than prompts x n (a side question off the episode's chain). The extra
rows train with their session's reward: padded to deal evenly over the DP ranks, with the
trainer's log-probs of every row's generated tokens equal to the engine's."""

import pytest
from train_helpers import ROOT, metrics_by_step, run_train

pytestmark = pytest.mark.e2e
AGENT = ROOT / "recipes/quickstart_cpu_tool_agent.yaml"


@pytest.mark.slow
def test_completions_off_the_chain_train_as_extra_rows(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_train(
        AGENT,
        run_dir,
        "trainer.total_steps=2",
        "actor.warm_start.steps=5",
        "actor.parallel.tp=1",
        "actor.parallel.dp=2",
        "actor.micro_batch_size=8",
        "actor.recompute_old_logp=always",
        "rollout.agent.fn=user_agents:calculator_after_a_side_question",
        "rollout.agent.max_rows_per_session=2",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = metrics_by_step(run_dir)
    assert sorted(steps) == [1, 2]
    for row in steps.values():
        # 8 prompts: one side question each -> 40 rows, padded to 48 (one mini-batch over dp 2
        # in micro-batches of 8 deals multiples of 16)
        assert row["agent/extra_rows"] == 8 and row["agent/unused_completions"] == 0
        assert row["generate/padding_rows"] == 8
        assert row["agent/errors"] == 0 and row["agent/timeouts"] == 0
        # the extra rows' generated tokens too: the engine's log-probs are the trainer's
        assert row["rollout/logp_diff_max"] < 1e-5
        assert row["actor/pg_loss"] == row["actor/pg_loss"]  # finite: the update ran
