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
- the last stage of a language model: the logits (R b V/tp in B, R = response length, for a role
  whose output layer runs on the response positions alone, `response_outputs(role)` of
  `rl3d.engine.micro_batches`, which its engine reads too; s b V/tp for any other), the fp32
  copy of the response positions' logits the vocab-parallel log-prob keeps (R b V/tp) and the
  output layer's input (s b h B, / tp with sequence parallelism).
The backward's transient (one layer's gradients of the above, the biggest at once) is added
once. With full recompute a layer keeps only its input (/ tp with sequence parallelism), and one
layer is recomputed at a time. Everything else (attention, the MLP's inner tensors) covers the
whole sequence on every TP rank either way: sequence parallelism divides only the hidden
states between the blocks.

A mixture of experts' MLP (megatron's `MoELayer`, `SequentialMLP` experts) keeps per token the
router's top-k indices (int64) and probabilities, its [experts] routing map (bool) and
probability map, the permutation's sorted indices (int64), and per routed copy (k of each
token) the permuted hidden state, its probability and the expert's SwiGLU tensors: fc1's
output (2 f_e) and four of width f_e, f_e = `moe_ffn_hidden_size` / etp (`moe_bytes`;
`tests/distributed/planning/test_moe_activations.py` counts the saved tensors of a built
layer). Routing is taken as balanced: each rank's experts see k copies of its tokens on
average; imbalance comes on top. A shared expert keeps its SwiGLU's fc1 output and three
tensors of its width, its sigmoid gate and its output; a router that normalises the softmax
over all experts before the top-k (`moe_norm_topk_prob` off) also keeps that softmax.
Under 1F1B a stage holds min(p - pp_rank, micro-batches) micro-batches in flight.
"""

from __future__ import annotations

from rl3d.costs.micro_batch import MicroBatchShape
from rl3d.engine.micro_batches import response_outputs
from rl3d.models.spec import ModelSpec
from rl3d.parallel.sharding import padded_vocab_size

FP32 = 4
INT64 = 8


def hidden_positions(tp: int, shape: MicroBatchShape) -> int:
    """Positions per row of the hidden states a rank keeps between the blocks."""
    return -(-shape.seq_len // tp) if shape.sequence_parallel else shape.seq_len


def moe_bytes(spec: ModelSpec, tp: int, etp: int | None, tokens: int, dtype_bytes: int) -> int:
    """What a mixture-of-experts MLP keeps for `tokens` tokens (the module docstring's list)."""
    k, experts, h, B = spec.moe_top_k, spec.num_experts, spec.hidden_size, dtype_bytes
    f_e = spec.moe_ffn_hidden_size // (etp or tp)
    routing = 2 * k * INT64 + k * FP32 + experts * (FP32 + 1)  # indices, probs, maps, sort
    if not spec.moe_norm_topk_prob:
        routing += experts * FP32  # the softmax over every expert, before the top-k
    routed = k * (h * B + FP32 + 6 * f_e * B)  # per copy sent to an expert
    shared = 0
    if spec.shared_expert_ffn_hidden_size:  # SwiGLU (fc1 2 f_s, three of f_s), its gate, its output
        shared = (5 * spec.shared_expert_ffn_hidden_size // tp + 1 + h) * B
    return tokens * (routing + routed + shared)


def layer_bytes(
    spec: ModelSpec,
    tp: int,
    shape: MicroBatchShape,
    dtype_bytes: int,
    *,
    etp: int | None = None,
    layer: int | None = None,
) -> int:
    """Bytes one decoder layer keeps for its backward (the module docstring's list); `etp`:
    the experts' tensor parallelism (None: `tp`, megatron's default); `layer`: its global index,
    which says whether a mixture of experts' layer is one of its dense first layers (None: a
    mixture-of-experts layer, where the model has experts)."""
    s, b, B = shape.seq_len, shape.rows, dtype_bytes
    h, d, f = spec.hidden_size, spec.head_dim, spec.ffn_hidden_size // tp
    heads = spec.num_attention_heads // tp
    kv = max(spec.num_query_groups // tp, 1)
    moe = spec.is_moe if layer is None else spec.is_moe_layer(layer)
    mlp = 0 if moe else 4 * f
    per_token = (heads + 2 * kv) * d + 2 * (heads + kv) * d + heads * d + mlp
    if kv < heads:
        per_token += 2 * heads * d  # K and V repeated to every query head
    if shape.flash:
        scores = s * b * heads * FP32  # log-sum-exp per row and head
    else:
        scores = b * heads * s * s * (FP32 + (B if B != FP32 else 0))
    norms = hidden_positions(tp, shape) * b * 6 * h * B
    experts = moe_bytes(spec, tp, etp, s * b, B) if moe else 0
    return s * b * per_token * B + norms + scores + experts


def output_bytes(
    spec: ModelSpec, tp: int, shape: MicroBatchShape, dtype_bytes: int, *, lm_head: bool, role: str
) -> int:
    """The last stage's output layer of role `role`: logits and the log-prob's fp32 copy
    (language model), or a value per token (critic, reward model). A language-model head runs on
    the R positions the loss reads where its engine runs it so (`response_outputs(role)`; a packed
    row is all R, `Packing.footprint`), else on all s; its input is the whole sequence's hidden
    states (the slice is a view of them)."""
    s, b = shape.seq_len, shape.rows
    if not lm_head:
        return s * b * (spec.hidden_size + 1) * dtype_bytes
    vocab = padded_vocab_size(spec.vocab_size, tp) // tp
    logit_positions = shape.response_len if response_outputs(role) else s
    return (
        logit_positions * b * vocab * dtype_bytes
        + shape.response_len * b * vocab * FP32
        + hidden_positions(tp, shape) * b * spec.hidden_size * dtype_bytes
    )


def pipeline_buffer_bytes(spec: ModelSpec, tp: int, pp: int, shape: MicroBatchShape, dtype_bytes: int) -> int:
    """A pipeline stage's send and receive buffers: one micro-batch's hidden states each way
    (megatron's p2p shape, [s / tp, b, h] under sequence parallelism); none without pipelining."""
    if pp == 1:
        return 0
    return 2 * hidden_positions(tp, shape) * shape.rows * spec.hidden_size * dtype_bytes


def stage_layer_bytes(
    spec: ModelSpec,
    tp: int,
    shape: MicroBatchShape,
    dtype_bytes: int,
    *,
    etp: int | None,
    first_layer: int,
    layers: int,
) -> list[int]:
    """`layer_bytes` of each of a stage's layers (each kind computed once)."""
    kinds = [spec.is_moe_layer(i) if spec.is_moe else False for i in range(first_layer, first_layer + layers)]
    size = {
        moe: layer_bytes(spec, tp, shape, dtype_bytes, etp=etp, layer=first_layer + kinds.index(moe))
        for moe in set(kinds)
    }
    return [size[moe] for moe in kinds]


def activation_bytes(
    spec: ModelSpec,
    *,
    role: str,
    tp: int,
    layers: int,
    last_stage: bool,
    lm_head: bool,
    shape: MicroBatchShape,
    dtype_bytes: int,
    trains: bool,
    etp: int | None = None,
    first_layer: int = 0,
) -> int:
    """Peak activation bytes of one rank's stage of role `role` (its engine's name: "actor",
    "reference", "critic", ...) for `shape` (`trains`: a backward follows; else a forward
    without autograd keeps one layer's tensors at a time); the stage holds layers `first_layer`
    to `first_layer + layers - 1` (a mixture of experts' dense first layers keep a dense MLP's
    activations)."""
    stage = stage_layer_bytes(spec, tp, shape, dtype_bytes, etp=etp, first_layer=first_layer, layers=layers)
    one_layer = max(stage)
    head = output_bytes(spec, tp, shape, dtype_bytes, lm_head=lm_head, role=role) if last_stage else 0
    if not trains:
        return one_layer + head
    if shape.recompute:
        kept = layers * hidden_positions(tp, shape) * shape.rows * spec.hidden_size * dtype_bytes + one_layer
    else:
        kept = sum(stage)
    return shape.in_flight * (kept + head) + one_layer  # + the backward's transient


def kept_bytes(spec: ModelSpec, *, tp: int, layers: int, shape: MicroBatchShape, dtype_bytes: int) -> int:
    """What autograd keeps after one training micro-batch's forward on a single-stage rank of the
    actor: the plan's activations less the backward's transient (what the CPU
    check measures with saved-tensor hooks)."""
    total = activation_bytes(
        spec,
        role="actor",
        tp=tp,
        layers=layers,
        last_stage=True,
        lm_head=True,
        shape=shape,
        dtype_bytes=dtype_bytes,
        trains=True,
    )
    return total - max(
        stage_layer_bytes(spec, tp, shape, dtype_bytes, etp=None, first_layer=0, layers=layers)
    )
