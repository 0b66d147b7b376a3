"""The push: the last step of a transition to an engine that keeps its own copy of the weights
as whole HF tensors (SGLang), planned from shapes alone with the transition.

SGLang's weight loaders take whole HF tensors (each SGLang TP rank slices its own part). So once
the transition has built a rank's generation shards, every rank of a generation-TP group
all-gathers the group's shards of each sharded parameter (it receives t_g - 1 shards of each:
`gather_bytes`), converts them to HF names and layout, and hands the engine the HF tensors in
buckets. Tensors come in the parameters' order (`model_params`; a tied output layer is left out,
the engine ties lm_head itself), each parameter's in `ParamInfo.hf`'s order, all in the
transition's dtype; a bucket closes before the tensor that would take it past `bucket_bytes`
(a larger tensor is a bucket alone: `plan.bucket_bounds`). Every rank of the group pushes every
bucket (each SGLang TP rank reads the copy on its own GPU).

The engine pushes exactly these buckets and reports what it pushed (names and bytes of each
bucket, bytes gathered); the executor (`Resharder.push`) raises on any difference from the plan
(`push_mismatch`) and counts the push in the transition's `TransitionStats` (`reshard/engine_*`).
An engine that reads the generation weights in place (the torch engine) has the empty push,
`NO_PUSH`: nothing gathered, no bucket.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rl3d.hybrid_engine.params import ParamInfo, SegmentTable
from rl3d.hybrid_engine.plan import bucket_bounds
from rl3d.models.params import hf_shapes
from rl3d.models.spec import ModelSpec
from rl3d.parallel.sharding import ShardKind
from rl3d.utils.dtypes import DTYPE_BYTES


@dataclass(frozen=True)
class HFTensor:
    """One whole HF tensor of the push, and the Megatron parameter it is converted from."""

    name: str
    source: str
    shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class PushBucket:
    tensors: tuple[HFTensor, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tensors)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


@dataclass(frozen=True)
class EnginePush:
    """The planned push of one generation rank: its buckets, in order, and the bytes it receives
    from its generation-TP group to make whole tensors."""

    buckets: tuple[PushBucket, ...] = ()
    gather_bytes: int = 0
    bucket_bytes: int = 0
    dtype: str = ""
    largest_gathered_bytes: int = 0  # one sharded parameter's t_g gathered shards (t_g > 1)

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    @property
    def largest_bucket_bytes(self) -> int:
        """The largest bucket: `bucket_bytes`, or more where one tensor alone exceeds it."""
        return max((b.nbytes for b in self.buckets), default=0)

    @property
    def peak_bytes(self) -> int:
        """The most a rank holds for the push beside its generation shards (what the memory
        plan charges): the largest bucket's whole HF tensors (new memory where they are gathered
        or converted) and its flat copy handed to the engine, plus one parameter's gathered
        shards while it is converted (t_g > 1)."""
        return 2 * self.largest_bucket_bytes + self.largest_gathered_bytes

    @property
    def num_tensors(self) -> int:
        return sum(len(b.tensors) for b in self.buckets)

    def summary(self) -> dict[str, Any]:
        """The push in `rl3d plan --json` (`engine_push`): per generation rank."""
        return {
            "bytes": self.nbytes,
            "buckets": len(self.buckets),
            "tensors": self.num_tensors,
            "bucket_bytes": self.bucket_bytes,
            "gather_bytes": self.gather_bytes,
            "largest_bucket_bytes": self.largest_bucket_bytes,
            "peak_bytes": self.peak_bytes,
        }


NO_PUSH = EnginePush()


def plan_engine_push(
    spec: ModelSpec, params: list[ParamInfo], t_g: int, *, dtype: str, bucket_bytes: int
) -> EnginePush:
    """The push of generation weights over `params` (the transition's, p_g = 1) at generation
    TP `t_g` to an engine that takes whole HF tensors, in buckets of at most `bucket_bytes`."""
    if bucket_bytes < 1:
        raise ValueError(f"rollout.sglang.bucket_mb must be > 0, got {bucket_bytes} bytes")
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPE_BYTES)}")
    element = DTYPE_BYTES[dtype]
    pushed = [p for p in params if not p.tied_copy]
    table = SegmentTable(pushed, t_g)
    gather = largest_gathered = 0
    tensors: list[HFTensor] = []
    for i, p in enumerate(pushed):
        if p.kind is not ShardKind.REPLICATED and t_g > 1:  # every other member's shard
            shard = sum(table.sizes[s] for s in table.shard(i, 0, t_g)) * element
            gather += (t_g - 1) * shard
            largest_gathered = max(largest_gathered, t_g * shard)
        shapes = hf_shapes(p, spec.vocab_size)
        assert len(shapes) == len(p.hf), (p.name, p.hf)
        for name, shape in zip(p.hf, shapes):
            numel = 1
            for s in shape:
                numel *= s
            tensors.append(HFTensor(name, p.name, shape, numel * element))
    bounds = bucket_bounds([t.nbytes for t in tensors], bucket_bytes)
    buckets = tuple(PushBucket(tuple(tensors[lo:hi])) for lo, hi in bounds)
    return EnginePush(buckets, gather, bucket_bytes, dtype, largest_gathered)


def push_mismatch(plan: EnginePush, pushed: Any) -> str | None:
    """How what an engine pushed (`pushed.buckets`: (names, bytes) of each bucket, in order;
    `pushed.gather_bytes`; None: nothing) differs from `plan`, or None when it is the plan."""
    got = [] if pushed is None else [(tuple(names), int(n)) for names, n in pushed.buckets]
    want = [(b.names, b.nbytes) for b in plan.buckets]
    if got != want:
        total = sum(n for _, n in got)
        head = (
            f"the engine push moved {total} bytes in {len(got)} buckets, "
            f"the plan has {plan.nbytes} bytes in {len(want)}"
        )
        for k, (a, b) in enumerate(zip(got, want)):
            if a != b:
                return f"{head}; bucket {k} differs: pushed {_bucket(a)}, planned {_bucket(b)}"
        return head
    gathered = 0 if pushed is None else int(pushed.gather_bytes)
    if gathered != plan.gather_bytes:
        return f"the engine push gathered {gathered} bytes of whole tensors, the plan has {plan.gather_bytes}"
    return None


def _bucket(bucket: tuple[tuple[str, ...], int]) -> str:
    names, nbytes = bucket
    shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
    return f"{len(names)} tensors ({shown}), {nbytes} bytes"
