"""The CPU quickstarts end to end: real torchrun, megatron actor at tp=2, reshard to t_g=1,
torch rollout engine, GRPO / PPO, checkpoints."""

import json
import math

import pytest
from train_helpers import GRPO, PPO, ROOT, metrics_by_step, run_train

import yaml
from rl3d.config import load_config
from rl3d.hybrid_engine.plan import plan_transition
from rl3d.models.spec import get_model_spec
from rl3d.parallel import ParallelLayout

pytestmark = pytest.mark.e2e


def planned_reshard_bytes(recipe, overrides=()) -> int:
    cfg = load_config(recipe, list(overrides)).config
    par = cfg.actor.parallel
    layout = ParallelLayout(par.pp, par.tp, par.dp)
    spec = get_model_spec(cfg.model.name)
    plan = plan_transition(
        spec, layout, cfg.rollout.t_g, cfg.rollout.p_g, dtype=cfg.model.dtype, strategies=("hybridflow",)
    )
    return plan.strategies["hybridflow"].comm_bytes_max


@pytest.mark.parametrize("t_g", [1, 2])
def test_grpo_quickstart_logs_planner_bytes_and_matching_logprobs(t_g, tmp_path):
    run_dir = tmp_path / "run"
    proc = run_train(GRPO, run_dir, "trainer.total_steps=3", "checkpoint.save_every=0", f"rollout.t_g={t_g}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = metrics_by_step(run_dir)
    assert sorted(steps) == [1, 2, 3]
    planned = planned_reshard_bytes(GRPO, [f"rollout.t_g={t_g}"])
    for row in steps.values():
        # the executor moved exactly the planner's bytes (t_g = t = 2 moves none: identity)
        assert row["reshard/bytes"] == planned and (planned > 0) == (t_g == 1)
        # the rollout engine's log-probs against the megatron actor's recomputed ones, same
        # tokens, fp32: stated tolerance 1e-5
        assert row["rollout/logp_diff_max"] < 1e-5
        assert math.isfinite(row["actor/pg_loss"]) and row["perf/tokens_per_s"] > 0
        # the paper's throughput is over the step's wall time, which holds every timed stage
        throughput = row["perf/throughput_tokens_per_s"]
        assert 0 < throughput <= row["perf/tokens_per_s"]
        assert row["perf/throughput_tokens_per_s_per_device"] == pytest.approx(throughput / 2, rel=1e-12)
        assert {"time/generate", "time/update_actor", "time/reshard", "reshard/seconds"} <= set(row)
    resolved = yaml.safe_load((run_dir / "resolved_config.yaml").read_text())
    assert resolved["trainer"]["total_steps"] == 3
    assert (run_dir / "reward_curve.png").stat().st_size > 0
    summary = (run_dir / "summary.txt").read_text()
    assert "mean reward" in summary and "a sample (step 3, reward " in summary
    # logging.samples (4 by default): decoded responses, one per prompt; the synthetic task has
    # no end id, so every response runs to max_new_tokens as it always did
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [1] * 4 + [2] * 4 + [3] * 4
    for s in samples:
        assert set(s) == {
            "step",
            "split",
            "prompt",
            "response",
            "reward",
            "finish_reason",
            "num_tokens",
            "source",
        }
        assert s["split"] == "train" and s["finish_reason"] == "length" and s["num_tokens"] == 8
        assert len(s["response"].split()) == 8 and 0.0 <= s["reward"] <= 1.0
    assert len({s["source"] for s in samples[:4]}) == 4


def test_reward_function_that_raises_stops_the_run_naming_the_prompt(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_train(
        GRPO,
        run_dir,
        "trainer.total_steps=2",
        "checkpoint.save_every=0",
        "reward.fn=user_rewards:raise_on_index_3",
        "reward.on_error=stop",
    )
    assert proc.returncode != 0
    assert "prompt 3" in proc.stderr and "raise_on_index_3" in proc.stderr, proc.stderr[-3000:]


@pytest.mark.slow
def test_reward_function_that_raises_is_skipped_and_counted(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_train(
        GRPO,
        run_dir,
        "trainer.total_steps=4",
        "checkpoint.save_every=0",
        "data.shuffle=false",
        "reward.fn=user_rewards:raise_on_index_3",
        "reward.on_error=skip",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    errors = [row["reward/errors"] for row in metrics_by_step(run_dir).values()]
    assert errors[0] == 4  # prompt 3 is in the first batch (no shuffle), with its n=4 samples


def test_bad_recipe_fails_before_any_rank_starts(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_train(GRPO, run_dir, "rollout.t_g=3")
    assert proc.returncode == 2
    assert "rollout.t_g" in proc.stderr and "must divide training t=2" in proc.stderr
    assert not (run_dir / "metrics.jsonl").exists()


@pytest.mark.slow
@pytest.mark.parametrize(
    "recipe, seed, steps",
    [(GRPO, 1, 200), (GRPO, 2, 200), (GRPO, 3, 200), (PPO, 1, 150)],
    ids=["grpo-seed1", "grpo-seed2", "grpo-seed3", "ppo"],
)
def test_quickstart_learns(recipe, seed, steps, tmp_path):
    """GRPO: the demo as `make demo` runs it, on three seeds (not chosen: the first three of the
    sweep in benchmarks/demo_sweep.py), each held to the README's promise: mean reward over the
    first 20 steps <= 0.6, over the last 20 >= 0.9, under 2 minutes of training on 2 cores.
    PPO: +0.1 in 150 steps."""
    run_dir = tmp_path / "run"
    overrides = [f"trainer.seed={seed}", f"trainer.total_steps={steps}", "checkpoint.save_every=0"]
    proc = run_train(recipe, run_dir, *overrides, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [metrics_by_step(run_dir)[s] for s in range(1, steps + 1)]
    assert all(math.isfinite(r["actor/pg_loss"]) for r in rows)
    first = sum(r["reward/score_mean"] for r in rows[:20]) / 20
    last = sum(r["reward/score_mean"] for r in rows[-20:]) / 20
    if recipe == PPO:
        assert last - first > 0.1, (first, last)
        return
    train_s = sum(r["time/step"] for r in rows)
    assert first <= 0.6 and last >= 0.9, (first, last)
    assert train_s < 120, train_s
    summary = (run_dir / "summary.txt").read_text()
    assert f"first 20 steps {first:.3f} -> last 20 steps {last:.3f}" in summary, summary


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["rloo", "reinforce_pp", "remax", "dapo"])
def test_every_algorithm_family_runs(algo, tmp_path):
    """Each GRPO-family block from yaml/algos drives the same loop for a few steps."""
    run_dir = tmp_path / "run"
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        f"defaults: [{GRPO}, algos/{algo}]\n"
        "actor: {mini_batch_size: 16, micro_batch_size: 8}\n"
        "data: {prompts_per_step: 8}\n"
        "rollout: {n: 4}\n"
    )
    extra = ["algorithm.overlong_buffer_length=4"] if algo == "dapo" else []
    proc = run_train(recipe, run_dir, "trainer.total_steps=3", "checkpoint.save_every=0", *extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = metrics_by_step(run_dir)
    assert sorted(rows) == [1, 2, 3] and all(math.isfinite(r["actor/pg_loss"]) for r in rows.values())


@pytest.mark.slow
def test_safe_rlhf_pushes_the_cost_under_its_threshold(tmp_path):
    """Safe-RLHF quickstart: reward and cost critics train, the Lagrange multiplier rises while
    the mean cost (random policy: ~0.5) exceeds the 0.1 threshold, and the cost falls."""
    run_dir = tmp_path / "run"
    recipe = ROOT / "recipes/quickstart_cpu_safe_rlhf.yaml"
    proc = run_train(recipe, run_dir, "trainer.total_steps=50", "checkpoint.save_every=0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [metrics_by_step(run_dir)[s] for s in range(1, 51)]
    assert all(math.isfinite(r["critic/vf_loss"]) and math.isfinite(r["cost_critic/vf_loss"]) for r in rows)
    first = sum(r["cost/mean"] for r in rows[:10]) / 10
    last = sum(r["cost/mean"] for r in rows[-10:]) / 10
    assert first > 0.3 and last < first - 0.15, (first, last)
    assert max(r["safe/lambda"] for r in rows) > 2.0  # raised while the constraint was violated


@pytest.mark.slow
def test_quickstart_from_an_hf_checkpoint(tmp_path):
    """model.hf_path: the actor, reference and critic trunk load a (tiny, random) HF Llama."""
    from rl3d.testing.tiny_hf import save_tiny_hf_model

    hf_dir = tmp_path / "hf"
    save_tiny_hf_model("tiny-llama", hf_dir, seed=5)
    run_dir = tmp_path / "run"
    proc = run_train(PPO, run_dir, "trainer.total_steps=2", f"model.hf_path={hf_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = metrics_by_step(run_dir)
    assert sorted(rows) == [1, 2] and rows[1]["rollout/logp_diff_max"] < 1e-4
    assert rows[1]["kl/actor_ref_k1"] == 0.0  # the reference starts as the loaded actor


@pytest.mark.slow
def test_parquet_prompts_with_a_bad_row_and_the_gsm8k_reward(tmp_path):
    """Text data end to end: parquet rows through a template and an HF tokenizer (built offline),
    a bad row reported with file:row and skipped, the gsm8k rule reward on decoded text."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["Q:", "what", "is", "plus", "?", "####"] + [str(i) for i in range(10)]
    vocab = {"[PAD]": 0, "[UNK]": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", eos_token="</s>"
    ).save_pretrained(str(tmp_path / "tok"))
    prompts = [
        "Q: what is 2 plus 3 ?",
        None,
        "Q: what is 4 plus 4 ?",
        "Q: what is 1 plus 1 ?",
        "Q: what is 5 plus 2 ?",
        "Q: what is 3 plus 3 ?",
    ]
    data = tmp_path / "train.parquet"
    pq.write_table(pa.table({"prompt": prompts, "answer": ["5", "1", "8", "2", "7", "6"]}), str(data))
    run_dir = tmp_path / "run"
    proc = run_train(
        GRPO,
        run_dir,
        f"data.train_files=[{data}]",
        f"data.tokenizer={tmp_path / 'tok'}",
        "data.synthetic=null",
        "reward.fn=gsm8k",
        "data.prompts_per_step=4",
        "actor.mini_batch_size=16",
        "trainer.total_steps=2",
        "checkpoint.save_every=0",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = (run_dir / "logs/rank0.log").read_text()
    assert f"skipping bad row {data}:1: missing prompt" in log and "skipped 1 bad rows" in log
    rows = metrics_by_step(run_dir)
    assert sorted(rows) == [1, 2] and all(0.0 <= r["reward/score_mean"] <= 1.0 for r in rows.values())
