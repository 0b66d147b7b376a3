"""Failure containment on a rollout rank (`rl3d.workers.rollout_guard`) over a stand-in worker
whose engine honours the same per-call settings as `RolloutWorker._before_forward` (an injected
hang, the cancel event, an injected raise): a prompt that hangs past `rollout.timeout_s` is
re-issued once and then dropped; an engine that raises is rebuilt within `rollout.max_restarts`
and the prompt re-issued on it; past the bound the rank stops naming itself and the cause."""

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from rl3d.single_controller.batch import DataBatch
from rl3d.single_controller.dispatch import INPUT_ROW
from rl3d.workers.rollout_guard import (
    Cancelled,
    ContainedGeneration,
    Faults,
    RolloutRankFailed,
    faults_from_env,
)

N = 2  # samples per prompt


class StandInWorker:
    pool_rank, version = 0, 3

    def __init__(self, broken: bool = False):
        self.call, self.broken, self.restarts, self.seeds = threading.local(), broken, 0, []

    def generate(self, one: DataBatch, *, step: int) -> DataBatch:
        call = self.call
        if call.hang_s:
            time.sleep(call.hang_s)
        if call.cancel.is_set():
            raise Cancelled("stopped")
        if call.raise_now or self.broken:
            raise RuntimeError("engine fault")
        self.seeds.append(step)
        index = one["index"] * N
        return DataBatch(
            {"seed": torch.full((N, 1), step), INPUT_ROW: torch.zeros(N, dtype=torch.long)}, {"index": index}
        )

    def restart_engine(self) -> None:
        self.restarts += 1
        self.broken = False


def cfg(timeout_s=0.3, reissue=True, max_restarts=0):
    return SimpleNamespace(
        rollout=SimpleNamespace(timeout_s=timeout_s, reissue=reissue, max_restarts=max_restarts)
    )


def prompts(num=3):
    return DataBatch({}, {"index": [10 + i for i in range(num)], "prompt_ids": [[1, 2]] * num})


def test_a_prompt_that_hangs_is_reissued_once_then_dropped():
    worker = StandInWorker()
    guard = ContainedGeneration(cfg(), worker, Faults(hangs={5: {1: 0.5}}))
    began = time.monotonic()
    out, counts = guard.generate(prompts(), step=5, seed=7)
    assert (counts.dropped, counts.reissued, counts.restarts) == (1, 1, 0)
    assert out["index"] == [10, 10, 12, 12]
    assert out[INPUT_ROW].tolist() == [0, 0, 2, 2]  # each row's place in the share
    assert time.monotonic() - began < 3.0  # two deadlines, not the hangs' end
    assert counts.metrics() == {"rollout/dropped": 1.0, "rollout/reissued": 1.0, "rollout/restarts": 0.0}


def test_without_reissue_a_hung_prompt_is_dropped_at_once():
    guard = ContainedGeneration(cfg(reissue=False), StandInWorker(), Faults(hangs={5: {0: 0.5}}))
    out, counts = guard.generate(prompts(2), step=5, seed=7)
    assert (counts.dropped, counts.reissued) == (1, 0) and out["index"] == [11, 11]


def test_an_engine_that_raises_is_rebuilt_and_the_prompt_reissued_on_it():
    worker = StandInWorker()
    guard = ContainedGeneration(cfg(max_restarts=1), worker, Faults(raises={3}))
    out, counts = guard.generate(prompts(), step=3, seed=7)
    assert (counts.dropped, counts.reissued, counts.restarts) == (0, 1, 1) and worker.restarts == 1
    assert out["index"] == [10, 10, 11, 11, 12, 12]
    assert worker.seeds == [7 * 4096, 7 * 4096 + 1, 7 * 4096 + 2]  # a prompt's seed, re-issued alike
    _, later = guard.generate(prompts(), step=4, seed=8)  # the fault happened once
    assert (later.dropped, later.reissued, later.restarts) == (0, 0, 0)


def test_engine_restarts_past_the_bound_stop_the_rank_naming_it_and_the_cause():
    worker = StandInWorker(broken=True)
    guard = ContainedGeneration(cfg(max_restarts=1), worker, Faults())
    worker.restart_engine = lambda: None  # the rebuilt engine fails too
    with pytest.raises(
        RolloutRankFailed, match=r"rollout pool rank 0: .*rollout.max_restarts = 1.*engine fault"
    ):
        guard.generate(prompts(), step=2, seed=1)


def test_faults_read_from_the_test_only_variable():
    faults = faults_from_env({"RL3D_TEST_ROLLOUT_FAULTS": "hang:2:1:30; raise:3"})
    assert faults.hangs == {2: {1: 30.0}} and faults.raises == {3}
    assert faults.before_call(3, 0) == (0.0, True) and faults.before_call(3, 0) == (0.0, False)
    assert faults_from_env({}).hangs == {}
    with pytest.raises(ValueError, match="RL3D_TEST_ROLLOUT_FAULTS"):
        faults_from_env({"RL3D_TEST_ROLLOUT_FAULTS": "stall:1"})


def test_a_call_that_does_not_stop_after_the_deadline_costs_its_engine():
    """Still running a second `timeout_s` after being told to stop: the engine is rebuilt (each
    try), and the prompt dropped; the abandoned calls end on their own (their cancel is set)."""
    worker = StandInWorker()
    guard = ContainedGeneration(cfg(max_restarts=2), worker, Faults(hangs={1: {0: 1.0}}))
    out, counts = guard.generate(prompts(2), step=1, seed=1)
    assert (counts.dropped, counts.reissued, counts.restarts) == (1, 1, 2) and worker.restarts == 2
    assert out["index"] == [11, 11]
    with pytest.raises(RolloutRankFailed, match=r"did not stop"):  # the bound reached
        guard.generate(prompts(1), step=1, seed=1)
