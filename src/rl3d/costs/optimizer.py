"""The optimizer step's cost: a fused Adam over a rank's parameters is memory-bound, 30 bytes
per parameter through HBM (read the fp32 gradient, master weight, m and v; write the master
weight, m, v and the bf16 weight)."""

from __future__ import annotations

ADAM_BYTES_PER_PARAM = 30


def adam_seconds(num_params: float, hbm_gbps: float) -> float:
    """One fused Adam step over `num_params` parameters at `hbm_gbps` GB/s of HBM."""
    return num_params * ADAM_BYTES_PER_PARAM / (hbm_gbps * 1e9)
