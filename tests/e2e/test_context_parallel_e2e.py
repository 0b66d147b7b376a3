"""GRPO on the demo (`recipes/quickstart_cpu_grpo.yaml`, 2 gloo ranks, fp32) with the actor at
`actor.parallel.cp: 2` against the same ranks at CP 1 as two data replicas.

Both runs generate alike: CP ranks count as data replicas for the 3D-HybridEngine and the
rollout (`ParallelLayout.as_data_replicas`), so each run's generation layout is 1-1-1-2 and the
rollouts of step 1 are the same. They train differently: DP 2 gives each rank half of every
mini-batch, CP 2 gives both ranks all of it and splits each sequence (ring attention, outputs
gathered back per sample, gradients reduced over the data-and-context group). Every metric of
3 steps (rewards, log-probs, losses, KL, gradient norm, the transition's counts) agrees within
1e-6 (measured: 4.8e-7 at most, in the rollout's log-prob gap; the losses and the gradient norm
within 1e-7), the wall-clock ones aside, and `actor/adv_std`: a standard deviation per
micro-batch, which depends on how samples are grouped into micro-batches (DP 2 gives each rank 8
of a mini-batch's 16, CP 2 runs all 16 in 2 micro-batches)."""

import pytest
from train_helpers import GRPO, TIMING, TIMING_KEYS, metrics_by_step, run_train

pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # two runs of 3 steps: about 1.5 min each at load 13
STEPS = ("trainer.total_steps=3", "checkpoint.save_every=0", "logging.tensorboard=false")
LAYOUTS = {"dp2": "{tp: 1, pp: 1, dp: 2}", "cp2": "{tp: 1, pp: 1, dp: 1, cp: 2}"}
TOL = 1e-6
PER_MICRO_BATCH = {"actor/adv_std"}


def test_grpo_at_cp2_equals_cp1(tmp_path):
    runs = {}
    for name, layout in LAYOUTS.items():
        proc = run_train(GRPO, tmp_path / name, f"actor.parallel={layout}", *STEPS)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = metrics_by_step(tmp_path / name)
    dp2, cp2 = runs["dp2"], runs["cp2"]
    assert sorted(dp2) == sorted(cp2) == [1, 2, 3]
    worst = {}
    for step in dp2:
        keys = {k for k in dp2[step] if not k.startswith(TIMING) and k not in TIMING_KEYS}
        assert keys == {k for k in cp2[step] if not k.startswith(TIMING) and k not in TIMING_KEYS}
        for key in sorted(keys - PER_MICRO_BATCH):
            a, b = dp2[step][key], cp2[step][key]
            if isinstance(a, str):
                assert a == b, (step, key, a, b)
                continue
            worst[key] = max(worst.get(key, 0.0), abs(a - b))
            assert abs(a - b) <= TOL * max(1.0, abs(a)), (step, key, a, b)
    print("largest |CP 2 - CP 1| per metric over 3 steps:", {k: v for k, v in worst.items() if v})
