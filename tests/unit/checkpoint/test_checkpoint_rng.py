import random

import numpy as np
import torch

from rl3d.checkpoint import (
    capture_rng_state,
    generator_state,
    load_rng_state,
    restore_generator,
    restore_rng_state,
    save_rng_state,
)


def _draw():
    return (
        [random.random() for _ in range(3)],
        np.random.rand(3).tolist(),
        np.random.randn(1).tolist(),  # leaves a cached gaussian in numpy's state
        torch.rand(3).tolist(),
        torch.randint(0, 1000, (4,)).tolist(),
    )


def test_capture_draw_restore_draw_is_identical():
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    _draw()
    state = capture_rng_state()
    first = _draw()
    restore_rng_state(state)
    assert _draw() == first


def test_state_round_trips_through_a_weights_only_file(tmp_path):
    path = tmp_path / "rng_rank0.pt"
    save_rng_state(path)
    first = _draw()
    _draw()
    load_rng_state(path)
    assert _draw() == first


def test_generator_state():
    gen = torch.Generator().manual_seed(11)
    torch.randn(5, generator=gen)
    state = generator_state(gen)
    first = torch.randn(5, generator=gen)
    other = torch.Generator().manual_seed(99)
    restore_generator(other, state)
    assert torch.equal(torch.randn(5, generator=other), first)
