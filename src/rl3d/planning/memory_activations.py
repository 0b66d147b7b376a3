"""Activation bytes of one micro-batch on one rank: what autograd keeps for the backward.

An estimate from shapes, counted tensor by tensor for megatron-core 0.16's local layer spec
(no dropout: rl3d sets it off) on one TP rank of `tp`, with s = sequence length, b = micro-batch
rows, B = bytes per element of `model.dtype`:
- each RMSNorm keeps its input and its normalised output, and the linear after it its input:
  3 s b h B per norm, two norms a layer; with sequence parallelism (`sequence_parallel`,
  `rl3d.models.sequence_parallel`) all three hold only this rank's s / tp positions (the linear
  keeps its input split and gathers it again in the backward), so 3 s b h B / tp;
- the fused QKV output, RoPE's rotated halves and the rotated q, k (local heads), GQA's
  repeated K and V when KV heads are fewer than query heads, the attention context;
- attention scores: megatron's local `DotProductAttention` keeps the softmax of the
  [b * heads, s, s] scores in fp32 (`attention_softmax_in_fp32`) plus, for 16-bit models, its
  cast back for the product with V; Transformer Engine's fused (flash) attention keeps only its
  output and the log-sum-exp per row;
- SwiGLU: fc1's output (2 f), SiLU's output (f) and the gated product fc2 reads (f);
- the last stage of a language model: the logits (s b V/tp in B), the fp32 copy of the
  response's logits the vocab-parallel log-prob keeps (R b V/tp, R = response length) and the
  output layer's input (s b h B, / tp with sequence parallelism).
The backward's transient (one layer's gradients of the above, the biggest at once) is added
once. With full recompute a layer keeps only its input (/ tp with sequence parallelism), and one
layer is recomputed at a time. Everything else (attention, the MLP's inner tensors) covers the
whole sequence on every TP rank either way: sequence parallelism divides only the hidden
states between the blocks. A mixture of experts' MLP is counted as a dense SwiGLU of the
model's `ffn_hidden_size`.
Under 1F1B a stage holds min(p - pp_rank, micro-batches) micro-batches in flight.
"""

from __future__ import annotations

from rl3d.costs.micro_batch import MicroBatchShape
from rl3d.models.spec import ModelSpec
from rl3d.parallel.sharding import padded_vocab_size

FP32 = 4


def hidden_positions(tp: int, shape: MicroBatchShape) -> int:
    """Positions per row of the hidden states a rank keeps between the blocks."""
    return -(-shape.seq_len // tp) if shape.sequence_parallel else shape.seq_len


def layer_bytes(spec: ModelSpec, tp: int, shape: MicroBatchShape, dtype_bytes: int) -> int:
    """Bytes one decoder layer keeps for its backward (the module docstring's list)."""
    s, b, B = shape.seq_len, shape.rows, dtype_bytes
    h, d, f = spec.hidden_size, spec.head_dim, spec.ffn_hidden_size // tp
    heads = spec.num_attention_heads // tp
    kv = max(spec.num_query_groups // tp, 1)
    per_token = (heads + 2 * kv) * d + 2 * (heads + kv) * d + heads * d + 4 * f
    if kv < heads:
        per_token += 2 * heads * d  # K and V repeated to every query head
    if shape.flash:
        scores = s * b * heads * FP32  # log-sum-exp per row and head
    else:
        scores = b * heads * s * s * (FP32 + (B if B != FP32 else 0))
    norms = hidden_positions(tp, shape) * b * 6 * h * B
    return s * b * per_token * B + norms + scores


def output_bytes(spec: ModelSpec, tp: int, shape: MicroBatchShape, dtype_bytes: int, *, lm_head: bool) -> int:
    """The last stage's output layer: logits and the log-prob's fp32 copy (language model), or a
    value per token (critic, reward model)."""
    s, b = shape.seq_len, shape.rows
    if not lm_head:
        return s * b * (spec.hidden_size + 1) * dtype_bytes
    vocab = padded_vocab_size(spec.vocab_size, tp) // tp
    return (
        s * b * vocab * dtype_bytes
        + shape.response_len * b * vocab * FP32
        + hidden_positions(tp, shape) * b * spec.hidden_size * dtype_bytes
    )


def pipeline_buffer_bytes(spec: ModelSpec, tp: int, pp: int, shape: MicroBatchShape, dtype_bytes: int) -> int:
    """A pipeline stage's send and receive buffers: one micro-batch's hidden states each way
    (megatron's p2p shape, [s / tp, b, h] under sequence parallelism); none without pipelining."""
    if pp == 1:
        return 0
    return 2 * hidden_positions(tp, shape) * shape.rows * spec.hidden_size * dtype_bytes


def activation_bytes(
    spec: ModelSpec,
    *,
    tp: int,
    layers: int,
    last_stage: bool,
    lm_head: bool,
    shape: MicroBatchShape,
    dtype_bytes: int,
    trains: bool,
) -> int:
    """Peak activation bytes of one rank's stage for `shape` (`trains`: a backward follows;
    else a forward without autograd keeps one layer's tensors at a time)."""
    one_layer = layer_bytes(spec, tp, shape, dtype_bytes)
    head = output_bytes(spec, tp, shape, dtype_bytes, lm_head=lm_head) if last_stage else 0
    if not trains:
        return one_layer + head
    if shape.recompute:
        kept = layers * hidden_positions(tp, shape) * shape.rows * spec.hidden_size * dtype_bytes + one_layer
    else:
        kept = layers * one_layer
    return shape.in_flight * (kept + head) + one_layer  # + the backward's transient


def kept_bytes(spec: ModelSpec, *, tp: int, layers: int, shape: MicroBatchShape, dtype_bytes: int) -> int:
    """What autograd keeps after one training micro-batch's forward on a single-stage rank with
    the language-model head: the plan's activations less the backward's transient (what the CPU
    check measures with saved-tensor hooks)."""
    total = activation_bytes(
        spec,
        tp=tp,
        layers=layers,
        last_stage=True,
        lm_head=True,
        shape=shape,
        dtype_bytes=dtype_bytes,
        trains=True,
    )
    return total - layer_bytes(spec, tp, shape, dtype_bytes)
