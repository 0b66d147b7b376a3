"""The 3D-HybridEngine executor: run a strategy's transition plan with torch.distributed.

Every rank calls `Resharder.to_generation(train_shards)` with its training shards (global
parameter names -> tensors). The strategy (looked up by name in the registry, see
`rl3d.hybrid_engine.strategy`) plans the transition once, at construction; executing it walks
the plan's collectives: each group gathers exactly the pieces the plan lists for its members,
so the bytes `CountedComm` counts are the planned bytes by construction. The engine offers
the strategies its shared machinery: the bucketed all-gather into one generation buffer,
the counted communicator, and the generation weights' bookkeeping. `Resharder.push` runs the
plan's last step, handing the generation weights to the rollout engine: an engine that takes
whole HF tensors (SGLang) pushes the buckets planned with the transition (`engine_push`), and
what it pushed is checked against them and counted with the transition.

Training and generation weights share one dtype (the training parameters' own; Megatron's
fp32 master copy stays in the optimizer), so the own shard can be reused in place.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import torch

from rl3d.hybrid_engine.comm import CountedComm, DeltaCounts, ReshardError
from rl3d.hybrid_engine.engine_push import NO_PUSH, EnginePush, plan_engine_push, push_mismatch
from rl3d.hybrid_engine.nodes import NodeMap
from rl3d.hybrid_engine.p2p import run_phases
from rl3d.hybrid_engine.params import ParamInfo, model_params, shard_shape, stages_of
from rl3d.hybrid_engine.plan import (
    Collective,
    StrategyPlan,
    bucket_bounds,
    expert_parts,
    plan_transition,
    slice_parts,
)
from rl3d.hybrid_engine.registry import get_strategy
from rl3d.hybrid_engine.weights import GenerationWeights
from rl3d.models.spec import ModelSpec
from rl3d.ops.layouts import ShardKind, merge_tp_shards, shard_for_tp
from rl3d.parallel.groups import HybridGroups

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TransitionStats:
    strategy: str
    recv_bytes: int
    send_bytes: int
    peak_param_bytes: int  # generation weights' distinct storage (buffers + reused shards)
    seconds: float
    verified: bool
    recv_from: dict[int, int] = field(default_factory=dict)  # sender -> logical bytes received
    calls: int = 0  # calls this rank issued (`CommCounter.calls`: a batched phase is one)
    # storage the transition allocated for the generation weights (the training tensors read
    # in place are not counted): 0 for an identity transition
    alloc_bytes: int = 0
    messages: int = 0  # chunks received: one per sender and call that sent this rank bytes
    # with `Resharder(time_phases=True)`: seconds per phase, summed over buckets (`PHASES`)
    phases: dict[str, float] = field(default_factory=dict)
    # the push to an engine that keeps its own copy as HF tensors (`engine_push`): 0 without one
    engine_bytes: int = 0
    engine_buckets: int = 0
    engine_gather_bytes: int = 0
    engine_seconds: float = 0.0
    delta: DeltaCounts | None = None  # a weight sync sent as deltas (rl3d.weight_sync.delta)

    def metrics(self) -> dict[str, float]:
        """`reshard/peak_bytes` is the memory the transition adds on top of the training
        weights; `reshard/gen_bytes` all of the generation weights, in-place pieces included.
        `reshard/engine_*` count the push (the plan's, checked): bytes handed to the engine, its
        buckets, bytes received in the generation-TP group to make whole tensors, its seconds."""
        return {
            "reshard/bytes": self.recv_bytes,
            "reshard/send_bytes": self.send_bytes,
            "reshard/peak_bytes": self.alloc_bytes,
            "reshard/gen_bytes": self.peak_param_bytes,
            "reshard/seconds": self.seconds,
            "reshard/engine_bytes": self.engine_bytes,
            "reshard/engine_buckets": self.engine_buckets,
            "reshard/engine_gather_bytes": self.engine_gather_bytes,
            "reshard/engine_seconds": self.engine_seconds,
        }


# What `time_phases` times: the generation buffer's allocation and its views (the peers' shards
# land in place, so this is all hybridflow's unpacking is), packing the rank's own shards, the
# collectives (waits included), point-to-point phases (packing and unpacking included), and
# assembling the generation weights from pieces. The plan is made once, at construction
# (`Resharder.plan_seconds`).
PHASES = ("buffer", "pack", "collective", "p2p", "assemble")


class Resharder:
    def __init__(
        self,
        spec: ModelSpec,
        groups: HybridGroups,
        *,
        strategy: str = "hybridflow",
        bucket_mb: float = 256.0,
        verify: bool = False,
        params: list[ParamInfo] | None = None,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
        kernel_backend: str | None = None,
        nodes: NodeMap | None = None,
        push_bucket_mb: float | None = None,
        time_phases: bool = False,
    ):
        start = time.perf_counter()
        self.spec, self.groups, self.strategy = spec, groups, strategy
        self.impl = get_strategy(strategy)()
        self.gen, self.train = groups.gen, groups.gen.train
        self.params = params if params is not None else model_params(spec, train_tp=self.train.t)
        self.by_name = {p.name: p for p in self.params}
        self.index_of = {p.name: i for i, p in enumerate(self.params)}
        self.nodes = nodes  # which ranks share a node (strategies that route per node)
        self.bucket_bytes = max(1, int(bucket_mb * 2**20))
        self.verify = verify
        self.rank = groups.rank
        self.comm = CountedComm(self.rank, groups.timeout_s)
        self.last_stats: TransitionStats | None = None
        self._on_bucket = None  # set for one overlapped call (see `to_generation`)
        self.dtype, self.device = dtype, torch.device(device)
        self.kernel_backend = kernel_backend  # None: RL3D_KERNEL_BACKEND, else auto
        dtype_name = str(dtype).removeprefix("torch.")
        self.plan: StrategyPlan = plan_transition(
            spec,
            self.train,
            self.gen.t_g,
            self.gen.p_g,
            dtype=dtype_name,
            strategies=(strategy,),
            params=self.params,
            nodes=nodes,
        ).strategies[strategy]
        # the last step, to an engine that takes whole HF tensors (`push_bucket_mb`, SGLang's)
        self.push_plan: EnginePush = NO_PUSH
        if push_bucket_mb is not None:
            self.push_plan = plan_engine_push(
                spec, self.params, self.gen.t_g, dtype=dtype_name, bucket_bytes=int(push_bucket_mb * 2**20)
            )
        self.plan_seconds = time.perf_counter() - start
        self.time_phases = time_phases
        self._phases: dict[str, float] | None = None  # this transition's, while it runs

    @contextmanager
    def phase(self, name: str):
        """Time the block as phase `name` of the running transition (nothing unless `time_phases`)."""
        if self._phases is None:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            self._phases[name] = self._phases.get(name, 0.0) + time.perf_counter() - start

    # -- what strategies build on --------------------------------------------------------------
    def stage_params(self, pp_rank: int, pp: int) -> list[ParamInfo]:
        return [p for p in self.params if pp_rank in stages_of(p, self.spec.num_layers, pp)]

    def train_split(self, param: ParamInfo) -> int:
        """How many training shards `param` is split into: an expert's over expert TP."""
        return self.train.expert_t if param.expert is not None else self.train.t

    def piece_numel(self, unit: str, param: ParamInfo, holder: int = 0, dst: int = 0) -> int:
        """Elements of one piece of `param` (see `plan.Collective`; a slice's: `holder`'s to `dst`)."""
        if unit == "slice":
            etp, tp_g = self.train.coords(holder).etp, self.gen.coords(dst).tp_g
            parts = slice_parts(self.train, self.gen.t_g, etp, tp_g)
            return len(parts) * param.numel // expert_parts(self.train, self.gen.t_g)
        if unit == "shard":
            return int(torch.Size(shard_shape(param, self.train_split(param))).numel())
        if unit == "zero_chunk":
            return -(-param.numel // self.train.world_size)
        return param.numel

    def gather(
        self, collective: Collective, train: dict[str, torch.Tensor], *, copy_own: bool, last: bool = True
    ) -> tuple[dict[tuple[int, str], torch.Tensor], torch.Tensor | None]:
        """Run this rank's group of an all-gather of training shards, bucketed.

        Returns views (member, name) -> shard into one buffer holding the peers' shards (and
        the rank's own too when `copy_own`), plus that buffer; ({}, None) off the collective.
        `last`: the transition's last all-gather, after whose buckets an update hook hears None
        (an earlier one's buckets would otherwise see the rest of the step run before them)."""
        assert collective.op == "all_gather" and collective.unit == "shard", collective
        found = collective.group_of(self.rank)
        if found is None:
            if last and self._on_bucket is not None:
                self._on_bucket(None)
            return {}, None
        ranks, contrib = found
        group = getattr(self.groups, collective.group_kind)
        assert list(group.ranks) == ranks, (collective.group_kind, group.ranks, ranks)
        dtype, device = self.dtype, self.device
        lists = {m: [self.params[i] for i in contrib[m]] for m in ranks}
        numels = {m: [self.piece_numel("shard", p) for p in lists[m]] for m in ranks}
        stored = [m for m in ranks if copy_own or m != self.rank]
        offsets, total = {}, 0
        for m in stored:
            offsets[m] = total
            total += sum(numels[m])
        with self.phase("buffer"):
            buffer = torch.empty(total, dtype=dtype, device=device) if total else None
            views: dict[tuple[int, str], torch.Tensor] = {}
            for m in stored:
                cursor = offsets[m]
                for p, n in zip(lists[m], numels[m]):
                    views[(m, p.name)] = buffer[cursor : cursor + n].view(shard_shape(p, self.train_split(p)))
                    cursor += n
        # Cut every member's list into buckets of at most bucket_bytes (a bigger tensor is alone).
        element = torch.empty((), dtype=dtype).element_size()
        cuts = {m: bucket_bounds(numels[m], self.bucket_bytes // element) for m in ranks}
        rounds = max(len(c) for c in cuts.values())
        pending = []  # with an update hook: (works, chunks) in flight while later buckets update
        for k in range(rounds):
            if self._on_bucket is not None:  # the optimizer updates this bucket, then it moves
                lo, hi = cuts[self.rank][k] if k < len(cuts[self.rank]) else (0, 0)
                self._on_bucket(lists[self.rank][lo:hi])
            chunks = {}
            for m in ranks:
                lo, hi = cuts[m][k] if k < len(cuts[m]) else (0, 0)
                start = sum(numels[m][:lo])
                size = sum(numels[m][lo:hi])
                if m in offsets:
                    chunks[m] = buffer[offsets[m] + start : offsets[m] + start + size]
                else:
                    chunks[m] = torch.empty(size, dtype=dtype, device=device)
                if m == self.rank and size:
                    from rl3d.ops import pack_bucket

                    with self.phase("pack"):
                        pack_bucket(
                            [train[p.name] for p in lists[m][lo:hi]],
                            out=chunks[m],
                            backend=self.kernel_backend,
                        )
            with self.phase("collective"):
                if self._on_bucket is None:
                    self.comm.all_gather_v(group, chunks)
                else:
                    pending.append((self.comm.all_gather_v(group, chunks, async_op=True), chunks))
        if last and self._on_bucket is not None:
            self._on_bucket(None)  # the rest of the step, while the last buckets move
        with self.phase("collective"):
            for works, _ in pending:
                self.comm.wait(works, group)
        return views, buffer

    def gather_all(self, plan: StrategyPlan, train, *, copy_own: bool):
        """Every all-gather of `plan`, in order: the views of all of them and their buffers."""
        views, buffers = {}, []
        if not plan.collectives and self._on_bucket is not None:
            self._on_bucket(None)  # nothing moves (identity): the whole update runs here
        for k, collective in enumerate(plan.collectives):
            last = k == len(plan.collectives) - 1
            got, buf = self.gather(collective, train, copy_own=copy_own, last=last)
            views.update(got)
            buffers += [buf] if buf is not None else []
        return views, buffers

    def _is_expert(self, name: str) -> bool:
        return name in self.by_name and self.by_name[name].expert is not None

    @staticmethod
    def is_replicated(param: ParamInfo) -> bool:
        return param.kind is ShardKind.REPLICATED

    def run_phases(self, plan: StrategyPlan, train) -> tuple[dict[tuple[int, int], torch.Tensor], list]:
        """Run the plan's point-to-point phases in order (`p2p.run_phases`). Returns what this
        rank received, by piece key (param index, holder's TP rank or -1 when replicated; an
        expert's part index for a slice), and the buffers."""
        with self.phase("p2p"):
            return run_phases(
                plan.phases,
                comm=self.comm,
                params=self.params,
                train=self.train,
                own=train,
                gen=self.gen,
                dtype=self.dtype,
                device=self.device,
                kernel_backend=self.kernel_backend,
            )

    def weights(self, pieces, full, buffers, gen_tp_rank, gen_tp_as_train: bool = False) -> GenerationWeights:
        return GenerationWeights(
            spec=self.spec,
            params=self.by_name,
            train_tp=self.gen.t_g if gen_tp_as_train else self.train.t,
            # an expert's pieces: its etp shards, or its parts when t_g > 1 cuts them (lcm(etp, t_g))
            expert_train_tp=self.gen.t_g if gen_tp_as_train else expert_parts(self.train, self.gen.t_g),
            gen_tp=self.gen.t_g,
            gen_tp_rank=gen_tp_rank,
            pieces=pieces,
            full=full,
            buffers=buffers,
        )

    # -- the physical limit --------------------------------------------------------------------
    def raw_transfer(self) -> int:
        """Move the plan's bytes over the plan's groups with one flat collective per group (no
        buckets, no packing, no layout): what the fabric does at best. Returns bytes received."""
        comm = CountedComm(self.rank, self.groups.timeout_s)
        me = self.rank

        def flat(numel: int) -> torch.Tensor:
            return torch.empty(numel, dtype=self.dtype, device=self.device)

        for c in self.plan.collectives:
            found = c.group_of(me)
            if found is None:
                continue
            ranks, contrib = found
            group = getattr(self.groups, c.group_kind)
            numel = {
                m: sum(self.piece_numel(c.unit, self.params[i]) for i in contrib.get(m, ())) for m in ranks
            }
            if c.op == "all_gather":
                comm.all_gather_v(group, {m: flat(k) for m, k in numel.items()})
            elif c.op == "gather":
                for src in ranks[1:]:
                    if me == src:
                        comm.send(group, flat(numel[src]), dst=ranks[0])
                    elif me == ranks[0]:
                        comm.recv(group, flat(numel[src]), src=src)
            else:
                comm.broadcast(group, flat(numel[ranks[0]]), src=ranks[0])
        for k, phase in enumerate(self.plan.phases):
            sizes = {
                t: sum(self.piece_numel(t.unit, self.params[i], h, t.dst) for h, i in t.pieces) for t in phase
            }
            sends = {t.dst: flat(n) for t, n in sizes.items() if t.src == me}
            recvs = {t.src: flat(n) for t, n in sizes.items() if t.dst == me}
            comm.exchange(sends, recvs, tag=k)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return comm.counter.recv_bytes

    # -- entry point ---------------------------------------------------------------------------
    def to_generation(
        self,
        train: dict[str, torch.Tensor],
        *,
        zero_shards: dict[str, torch.Tensor] | None = None,
        on_bucket=None,
    ) -> GenerationWeights | None:
        """Build this rank's generation weights (collective: every rank calls it).

        `train` maps global parameter names to this rank's training shards (empty on rollout-only
        ranks); a strategy that starts from ZeRO-3 partitions takes them as `zero_shards`.
        Returns None on ranks that end up with no generation weights.

        `on_bucket(params)` overlaps the transition with the optimizer step: it is called with
        the parameters of this rank's next bucket and must return once their update is done;
        the bucket's all-gather then starts in the background while the next bucket updates.
        Once the last collective's buckets are all started it is called with None (once):
        update whatever is left, while they finish. With several all-gathers (expert
        parallelism's experts after the dense weights, PP's norms) each piece is offered once,
        in the order it is packed. Without it (the default) every all-gather runs to
        completion before the next starts, exactly as before."""
        if on_bucket is not None and not self.impl.overlaps_buckets:
            raise ValueError(
                f"{self.strategy} cannot overlap with the optimizer step (no bucketed all-gather)"
            )
        self._on_bucket = on_bucket
        try:
            return self._to_generation(train, zero_shards)
        finally:
            self._on_bucket = None

    def _to_generation(self, train, zero_shards) -> GenerationWeights | None:
        for name, t in (zero_shards or train).items():
            if t.dtype != self.dtype or t.device != self.device:
                raise ReshardError(
                    f"rank {self.rank}: {name} is {t.dtype} on {t.device}, "
                    f"expected {self.dtype} on {self.device}"
                )
        self.comm.counter.reset()
        if self.rank >= self.train.world_size and not self.impl.uses_rollout_ranks:
            self.last_stats = TransitionStats(self.strategy, 0, 0, 0, 0.0, False)
            return None  # a rollout-only rank has no part in this strategy
        if self.impl.needs_zero_shards and zero_shards is None:
            raise ValueError(f"{self.strategy} needs zero_shards (the ZeRO-3 partition of the weights)")
        self._phases = {} if self.time_phases else None
        start = time.perf_counter()
        try:
            weights = self.impl.execute(self.plan, self, train, zero_shards)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        finally:
            phases, self._phases = self._phases or {}, None
        seconds = time.perf_counter() - start
        recv, send = self.comm.counter.recv_bytes, self.comm.counter.send_bytes
        if self.verify:  # an independent path: whole tensors gathered as objects, then sliced
            full = self._gather_full_model(train, zero_shards)
            if weights is not None:
                verify_against(weights, full, rank=self.rank)
        self.last_stats = TransitionStats(
            self.strategy,
            recv,
            send,
            weights.storage_bytes() if weights is not None else 0,
            seconds,
            self.verify,
            dict(self.comm.counter.recv_from),
            self.comm.counter.calls,
            weights.storage_bytes(exclude=train.values()) if weights is not None else 0,
            self.comm.counter.messages,
            phases,
        )
        return weights

    def push(self, engine, weights: GenerationWeights | None) -> None:
        """The plan's last step: hand `weights` to the rollout engine (`engine.load_weights`).
        An engine that takes whole HF tensors pushes `push_plan`'s buckets and returns what it
        pushed; anything else than the plan raises `ReshardError`. The push is counted into
        `last_stats` (`reshard/engine_*`); an engine that reads the weights in place pushes
        nothing and returns None (the empty plan: every `engine_*` counter 0)."""
        plan = self.push_plan
        start = time.perf_counter()
        pushed = engine.load_weights(weights)
        if plan.buckets and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - start if plan.buckets else 0.0
        problem = push_mismatch(plan, pushed)
        if problem is not None:
            raise ReshardError(f"rank {self.rank}: {problem}")
        self.last_stats = replace(
            self.last_stats,
            engine_bytes=plan.nbytes,
            engine_buckets=len(plan.buckets),
            engine_gather_bytes=plan.gather_bytes,
            engine_seconds=seconds,
        )

    def _gather_full_model(self, train, zero_shards) -> dict[str, torch.Tensor]:
        """The full model on every rank via all_gather_object (slow; verification only)."""
        import torch.distributed as dist

        coords = self.train.coords(self.rank) if self.rank < self.train.world_size else None
        if zero_shards is not None:
            mine = ("zero", self.rank, {k: v.cpu() for k, v in zero_shards.items()})
        elif coords is not None and (coords.dp == 0 or coords.edp == 0):
            # data-parallel rank 0 sends its dense weights, expert-DP rank 0 its experts (by TP
            # and expert TP rank)
            sent = {
                k: (coords.etp if self._is_expert(k) else coords.tp, v.cpu())
                for k, v in train.items()
                if (coords.edp == 0 if self._is_expert(k) else coords.dp == 0)
            }
            mine = ("tp", 0, sent)
        else:
            mine = ("none", 0, {})
        group = None if self.impl.uses_rollout_ranks else self.groups.world
        size = dist.get_world_size() if group is None else group.size
        everyone: list = [None] * size
        dist.all_gather_object(everyone, mine, group=None if group is None else group.handle)
        full = {}
        for p in self.params:
            if p.kind is ShardKind.REPLICATED or zero_shards is not None:
                chunks = [(i, d[p.name]) for kind, i, d in everyone if p.name in d]
                if zero_shards is None:
                    chunks = [(i, tensor) for _, (i, tensor) in chunks]
            else:
                chunks = sorted(
                    (d[p.name] for kind, _, d in everyone if kind == "tp" and p.name in d), key=lambda x: x[0]
                )
            if not chunks:
                continue
            if zero_shards is not None:
                flat = torch.cat([c for _, c in sorted(chunks, key=lambda x: x[0])])
                full[p.name] = flat[: p.numel].view(p.shape)
            elif p.kind is ShardKind.REPLICATED:
                full[p.name] = chunks[0][1]
            else:
                full[p.name] = merge_tp_shards([c for _, c in chunks], p.kind)
        return {k: v.to(self.device) for k, v in full.items()}


def verify_against(weights: GenerationWeights, full: dict[str, torch.Tensor], *, rank: int) -> None:
    """Every generation shard must equal the direct slice of the full model, bit for bit."""
    for name in weights.names():
        p = weights.params[name]
        expected = shard_for_tp(full[name], p.kind, weights.gen_tp, weights.gen_tp_rank)
        got = weights.reference_materialize(name)
        if got.shape != expected.shape or not torch.equal(got, expected):
            raise ReshardError(
                f"rank {rank}: generation shard of {name} (gen tp {weights.gen_tp_rank}/{weights.gen_tp}) "
                f"differs from the full model's slice: checksum {_checksum(got)} != {_checksum(expected)}"
            )


def _checksum(t: torch.Tensor) -> str:
    """sha1 of the raw bytes: any difference in any element or position shows."""
    import hashlib

    raw = t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
    return f"{hashlib.sha1(raw).hexdigest()[:12]}{tuple(t.shape)}"
