"""Packing in the whole PPO loop: actor and critic at DP=2 with packed, token-
balanced micro-batches against the padded run. One optimizer step per step (mini-batch = the
step's 32 samples), so both runs train on the same mini-batches and their metrics agree within
fp32 tolerance; the packed run computes no pad slots. Two metrics are means of a non-linear
statistic per micro-batch (a standard deviation, an explained variance) and so depend on how
samples are grouped into micro-batches, which packing changes: they are left out."""

import pytest
from train_helpers import PPO, TIMING, TIMING_KEYS, metrics_by_step, run_train

pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # two runs of 2 steps: about 2.5 min here

COMMON = (
    "trainer.total_steps=2",
    "checkpoint.save_every=0",
    "actor.parallel.tp=1",
    "actor.parallel.dp=2",
    "critic.parallel.tp=1",
    "critic.parallel.dp=2",
    "actor.mini_batch_size=32",
    "critic.mini_batch_size=32",
)
PER_MICRO_BATCH = {"actor/adv_std", "critic/vf_explained_var"}
PACKED = ("actor.packing=true", "critic.packing=true", "critic.max_tokens_per_micro_batch=96")


def test_packed_dp2_loop_matches_padded(tmp_path):
    runs = {}
    for name, extra in (("padded", ()), ("packed", PACKED)):
        proc = run_train(PPO, tmp_path / name, *COMMON, *extra)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = metrics_by_step(tmp_path / name)
    padded, packed = runs["padded"], runs["packed"]
    for step in padded:
        assert packed[step]["perf/pad_fraction"] == 0.0 <= padded[step]["perf/pad_fraction"]
        keys = {
            k for k in padded[step] if not k.startswith(TIMING) and k not in TIMING_KEYS | PER_MICRO_BATCH
        }
        for key in sorted(keys):
            a, b = padded[step][key], packed[step][key]
            assert b == (a if isinstance(a, str) else pytest.approx(a, rel=1e-4, abs=1e-5)), (step, key, a, b)
