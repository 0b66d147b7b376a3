"""What one micro-batch looks like to the model on one rank: the shape the memory plan counts
activations for (`rl3d.planning.memory_activations`), and that each model technique shapes
(`rl3d.engine.features.Feature.footprint`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MicroBatchShape:
    """What one micro-batch looks like to the model on one rank."""

    seq_len: int  # s: tokens per row (a packed row holds several sequences)
    rows: int  # b
    response_len: int  # R: positions whose logits the loss reads
    flash: bool  # Transformer Engine's fused attention (packing on CUDA), else megatron's local
    recompute: bool = False  # full activation recompute, one layer at a time
    in_flight: int = 1  # micro-batches whose activations a PP stage holds at once (1F1B)
    sequence_parallel: bool = False  # hidden states between the blocks split over TP (s a multiple of tp)
