"""Reward shaping applied to sequence scores before advantage estimation."""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def overlong_penalty(
    response_lengths_B: Tensor,
    *,
    max_response_length: int,
    overlong_buffer_length: int,
    penalty_factor: float = 1.0,
) -> Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, Eq. 13), to be added to the scores.

    With `L_max = max_response_length`, `L_cache = overlong_buffer_length` and `|y|` the length:
        0                                   if |y| <= L_max - L_cache
        ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max
        -1                                  if |y| > L_max
    all scaled by `penalty_factor`. Responses in the last `L_cache` tokens before the limit are
    punished linearly more the closer they get to it, instead of a cliff at truncation.
    """
    if max_response_length <= 0:
        raise ValueError(f"max_response_length must be > 0, got {max_response_length}")
    if not 0 < overlong_buffer_length <= max_response_length:
        raise ValueError(
            f"overlong_buffer_length must be in (0, max_response_length={max_response_length}], "
            f"got {overlong_buffer_length}"
        )
    expected_length = max_response_length - overlong_buffer_length
    excess_B = response_lengths_B.to(torch.float32) - expected_length
    penalty_B = (-excess_B / overlong_buffer_length).clamp(min=-1.0, max=0.0)
    return penalty_factor * penalty_B
