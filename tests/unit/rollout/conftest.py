"""Fixtures the SGLang stand-in tests share: a one-rank megatron world, and SIGQUIT's handler
restored after a launch (the launch leaves rl3d's installed; the next tests get pytest's back)."""

import signal

import pytest

from rl3d.testing.spawn import one_rank_world


@pytest.fixture(scope="module")
def groups():
    from rl3d.models.bootstrap import destroy_megatron, init_megatron
    from rl3d.parallel.layout import ParallelLayout

    with one_rank_world():
        yield init_megatron(ParallelLayout(1, 1, 1), seed=1)
        destroy_megatron()


@pytest.fixture
def sigquit_restored():
    previous = signal.getsignal(signal.SIGQUIT)
    yield
    signal.signal(signal.SIGQUIT, previous)
