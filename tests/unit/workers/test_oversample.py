"""Over-sampling on a separate rollout pool (`rl3d.workers.oversample`) on a real torch engine
that follows a script (the bigram machine: the prompt's last token decides the response), so
each sample's length is known: `SHORT` prompts stop after one token, `LONG` ones run to
`rollout.max_new_tokens`.

- the engine's early stop ends a call once enough groups are complete, leaving the others
  "aborted" with the tokens they have, and per-row limits end rows with "length";
- the over-sampler trains on the first complete groups, carries the rest (continued where
  they stopped, each token keeping its policy version) and drops a carried group past
  `rollout.async.drop_staleness`.
"""

from types import SimpleNamespace

import pytest

from rl3d.config import ConfigError, load_config
from rl3d.rollout import SamplingParams
from rl3d.rollout.torch_engine import EarlyStop
from rl3d.single_controller.batch import DataBatch
from rl3d.testing.bigram import bigram_engine
from rl3d.workers.oversample import OverSampler

ASYNC = "recipes/quickstart_cpu_grpo_async.yaml"
STOP, SHORT, LONG = 3, 9, 10
NEXT = {SHORT: STOP} | {t: t + 1 for t in range(LONG, 30)}  # LONG -> 11 -> 12 -> ... (no stop)


def engine():
    return bigram_engine("tiny-llama-v32", NEXT, pad_token_id=0)


def test_early_stop_aborts_the_rest_once_enough_groups_are_complete():
    eng = engine()
    params = SamplingParams(max_new_tokens=8, stop_token_ids=[STOP], n=1, seed=0)
    eng.early_stop = EarlyStop(groups=[0, 1, 1, 2], limits=[8, 8, 8, 8], target=2)
    out = eng.generate([[5, SHORT], [5, LONG], [5, SHORT], [5, SHORT]], params)
    # groups 0 and 2 complete at the first token; group 1's long row is cut there
    assert out.finish_reasons == ["stop", "aborted", "stop", "stop"]
    assert out.responses() == [[STOP], [11], [STOP], [STOP]]
    eng.early_stop = EarlyStop(groups=[0], limits=[5], target=1)  # a row's own limit
    out = eng.generate([[5, LONG, 11]], params)
    assert out.finish_reasons == ["length"] and out.responses() == [[12, 13, 14, 15, 16]]
    eng.early_stop = None
    out = eng.generate([[5, LONG]], params)  # without it: the whole budget
    assert out.responses() == [[11, 12, 13, 14, 15, 16, 17, 18]]


def test_early_stop_refuses_several_samples_per_prompt():
    eng = engine()
    eng.early_stop = EarlyStop(groups=[0], limits=[4], target=1)
    with pytest.raises(ValueError, match="n 1"):
        eng.generate([[5, SHORT]], SamplingParams(max_new_tokens=4, n=2, seed=0))


def rank(cfg):
    """A rollout rank's parts the over-sampler uses: a real engine, the rank's version, and the
    hook `RolloutWorker` sets (each token's logits' version)."""
    worker = SimpleNamespace(engine=engine(), dp_rank=0, pad_token_id=0, version=0, _chunk_versions=[])

    def before_forward(step):
        if step == 0:
            worker._chunk_versions.append([])
        worker._chunk_versions[-1].append(worker.version)

    worker.engine.before_forward = before_forward
    return worker


def prompts(last_tokens, first):
    n = len(last_tokens)
    return DataBatch(
        {}, {"prompt_ids": [[5, t] for t in last_tokens], "index": list(range(first, first + n)),
             "uid": list(range(first, first + n))},
    )  # fmt: skip


def config(*overrides):
    base = ["rollout.n=2", "rollout.max_new_tokens=6", f"rollout.stop_token_ids=[{STOP}]"]
    return load_config(ASYNC, ["data.max_prompt_length=4", *base, *overrides]).config


def test_stragglers_are_carried_with_their_versions_and_stale_ones_dropped():
    cfg = config("rollout.async.oversample=2", "rollout.async.drop_staleness=2")
    worker = rank(cfg)
    sampler = OverSampler(cfg, worker)
    batches = iter([prompts([LONG, SHORT], 0), prompts([SHORT, LONG], 2), prompts([SHORT, SHORT], 4)] * 3)
    draw = lambda: next(batches)  # noqa: E731
    # step 1: 4 groups in flight (2 needed): the two SHORT ones complete at once, the LONG ones
    # are cut after one token and carried
    batch, counts = sampler.generate(draw, step=1, seed=16)
    assert sorted(set(batch["index"])) == [1, 2]
    assert counts["rollout/in_flight"] == 4 and counts["rollout/oversampled"] == 2
    assert counts["rollout/carried"] == 2 and counts["rollout/aborted_samples"] == 4
    assert counts["rollout/carried_trained"] == 0 and counts["rollout/stale_dropped"] == 0
    assert (batch["policy_version"][batch["response_mask"].bool()] == 0).all()
    # step 2 at version 1: the carried LONG groups go on from their first token, new SHORT
    # prompts fill up and complete first; the LONG ones stay carried
    worker.version = 1
    batch, counts = sampler.generate(draw, step=2, seed=32)
    assert sorted(set(batch["index"])) == [4, 5]
    assert counts["rollout/carried"] == 2 and counts["rollout/carried_trained"] == 0
    long_group = sampler.carried[0]
    assert long_group.began == 1 and long_group.samples[0].ids == [11, 12]
    assert long_group.samples[0].versions == [0, 1]  # each token its version
    # step 3: no new prompt completes before the LONG ones reach their budget: they train,
    # each token with the version it was sampled with
    worker.version = 2
    batch, counts = sampler.generate(lambda: prompts([LONG, LONG], 6), step=3, seed=48)
    assert sorted(set(batch["index"])) == [0, 3]
    assert counts["rollout/carried_trained"] == 2
    rows = [i for i, ix in enumerate(batch["index"]) if ix == 0]
    assert batch["responses"][rows[0], :6].tolist() == [11, 12, 13, 14, 15, 16]
    assert batch["policy_version"][rows[0], :6].tolist() == [0, 1, 2, 2, 2, 2]
    assert batch["rollout_logp"].shape == batch["responses"].shape
    # step 6: the LONG groups drawn at step 3 hold version-2 tokens: 5 - 2 = 3 > drop_staleness 2
    worker.version = 5
    _, counts = sampler.generate(lambda: prompts([SHORT, SHORT], 8), step=6, seed=96)
    assert counts["rollout/stale_dropped"] == 2


@pytest.mark.parametrize(
    "overrides,says",
    [
        (["rollout.placement=colocated", "rollout.async.max_staleness=0"], "placement: separate"),
        (["algorithm.rollout_correction.mode=none"], "rollout_correction"),
        (["algorithm.dynamic_sampling=true"], "dynamic_sampling"),
        (["rollout.timeout_s=3"], "rollout.timeout_s"),
        (["rollout.n=64"], "over the engine's 256"),
    ],
)
def test_oversample_refusals_name_the_key(overrides, says):
    with pytest.raises(ConfigError) as err:
        load_config(ASYNC, ["rollout.async.oversample=1.5", *overrides])
    assert err.value.key == "rollout.async.oversample" and says in str(err.value)


def test_drop_staleness_needs_oversample_and_covers_max_staleness():
    with pytest.raises(ConfigError) as err:
        load_config(ASYNC, ["rollout.async.drop_staleness=2"])
    assert err.value.key == "rollout.async.drop_staleness"
    with pytest.raises(ConfigError) as err:
        load_config(ASYNC, ["rollout.async.oversample=2", "rollout.async.drop_staleness=0"])
    assert err.value.key == "rollout.async.drop_staleness"
    cfg = load_config(ASYNC, ["rollout.async.oversample=1.5"]).config
    from rl3d.config.async_rollout import staleness_bound

    assert staleness_bound(cfg) == 2 and cfg.rollout.async_.oversample == 1.5
