"""Fixtures the SGLang stand-in tests share: a one-rank megatron world, and SIGQUIT's handler
restored after a launch (the launch leaves rl3d's installed; the next tests get pytest's back)."""

import datetime
import signal

import pytest
import torch.distributed as dist

from rl3d.utils.net import free_port


@pytest.fixture(scope="module")
def groups():
    from rl3d.models.bootstrap import destroy_megatron, init_megatron
    from rl3d.parallel.layout import ParallelLayout

    owns_world = not dist.is_initialized()
    if owns_world:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
            timeout=datetime.timedelta(seconds=60),
        )  # fmt: skip
    yield init_megatron(ParallelLayout(1, 1, 1), seed=1)
    destroy_megatron()
    if owns_world:
        dist.destroy_process_group()


@pytest.fixture
def sigquit_restored():
    previous = signal.getsignal(signal.SIGQUIT)
    yield
    signal.signal(signal.SIGQUIT, previous)
