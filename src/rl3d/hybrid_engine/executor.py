"""The 3D-HybridEngine executor: run a transition plan with torch.distributed (gloo or NCCL).

Every rank calls `Resharder.to_generation(train_shards)` with its training shards (global
parameter names -> tensors). The result is the rank's `GenerationWeights`; the executor counts
the bytes it really moves (`CountedComm`) and measures the generation weights' storage, and
tests hold both equal to the planner's numbers.

Strategies (see `rl3d.hybrid_engine.plan` for the accounting):
- hybridflow: bucketed all-gather inside the micro-DP group (TP-sharded parameters) and inside
  its same-TP subgroup (replicated norms, only when PP folds into micro-DP). Received chunks
  land in one generation buffer of exactly (generation shard - own shard) bytes; the rank's own
  training tensors are reused as pieces, same storage, never copied.
- hybridflow_v: all-gather of the whole replica over its t*p ranks into a separate buffer.
- ds_chat: training weights ZeRO-3 partitioned over all ranks (pass `zero_shards`); one
  all-gather per parameter over the world, as DeepSpeed's ZeRO-3 does.
- openrlhf: trainer rank 0 receives every missing shard point to point, then broadcasts each
  bucket of full tensors to the rollout ranks (world ranks train_world ..).

Training and generation weights share one dtype (the training parameters' own; Megatron's
fp32 master copy stays in the optimizer), so the own shard can be reused in place.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rl3d.hybrid_engine.comm import CountedComm, ReshardError
from rl3d.hybrid_engine.params import ParamInfo, model_params, stages_of
from rl3d.hybrid_engine.weights import GenerationWeights, shard_shape
from rl3d.models.spec import ModelSpec
from rl3d.ops.layouts import ShardKind, merge_tp_shards, shard_for_tp
from rl3d.parallel.groups import Group, HybridGroups

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TransitionStats:
    strategy: str
    recv_bytes: int
    send_bytes: int
    peak_param_bytes: int  # generation weights' distinct storage (buffers + reused shards)
    seconds: float
    verified: bool

    def metrics(self) -> dict[str, float]:
        return {
            "reshard/bytes": self.recv_bytes,
            "reshard/send_bytes": self.send_bytes,
            "reshard/peak_bytes": self.peak_param_bytes,
            "reshard/seconds": self.seconds,
        }


def _vanilla_gen_coords(groups: HybridGroups, rank: int) -> tuple[int, int]:
    """(gen tp, gen pp) under the vanilla grouping the baselines use: a replica's ranks in
    megatron order (tp fastest, then micro-DP, then pp) with no regrouping."""
    gen, train = groups.gen, groups.gen.train
    c = train.coords(rank)
    q = c.tp + train.t * c.pp
    return q % gen.t_g, q // (gen.t_g * gen.d_g)


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
    ):
        self.spec, self.groups, self.strategy = spec, groups, strategy
        self.gen, self.train = groups.gen, groups.gen.train
        self.params = params if params is not None else model_params(spec, train_tp=self.train.t)
        self.by_name = {p.name: p for p in self.params}
        self.bucket_bytes = max(1, int(bucket_mb * 2**20))
        self.verify = verify
        self.rank = groups.rank
        self.comm = CountedComm(self.rank, groups.timeout_s)
        self.last_stats: TransitionStats | None = None
        self.dtype, self.device = dtype, torch.device(device)
        self.kernel_backend = kernel_backend  # None: RL3D_KERNEL_BACKEND, else auto

    # -- inventories ---------------------------------------------------------------------------
    def _stage_params(self, pp_rank: int, pp: int) -> list[ParamInfo]:
        return [p for p in self.params if pp_rank in stages_of(p, self.spec.num_layers, pp)]

    def _train_coords(self, rank: int) -> tuple[int, int]:
        c = self.train.coords(rank)
        return c.pp, c.tp

    # -- the shared bucketed gather ------------------------------------------------------------
    def _gather(
        self,
        group: Group,
        contrib_of: Callable[[int], list[ParamInfo]],
        train: dict[str, torch.Tensor],
        *,
        copy_own: bool,
        dtype: torch.dtype,
        device: torch.device,
    ) -> tuple[dict[tuple[int, str], torch.Tensor], torch.Tensor | None]:
        """All-gather each member's `contrib_of(member)` training shards inside `group`.

        Returns views (member, name) -> shard, into one buffer holding the peers' shards (and
        the rank's own too when `copy_own`), plus that buffer."""
        tp = self.train.t
        lists = {m: contrib_of(m) for m in group.ranks}
        numels = {m: [int(torch.Size(shard_shape(p, tp)).numel()) for p in lists[m]] for m in group.ranks}
        stored = [m for m in group.ranks if copy_own or m != self.rank]
        offsets, total = {}, 0
        for m in stored:
            offsets[m] = total
            total += sum(numels[m])
        buffer = torch.empty(total, dtype=dtype, device=device) if total else None
        views: dict[tuple[int, str], torch.Tensor] = {}
        for m in stored:
            cursor = offsets[m]
            for p, n in zip(lists[m], numels[m]):
                views[(m, p.name)] = buffer[cursor : cursor + n].view(shard_shape(p, tp))
                cursor += n
        # Cut every member's list into buckets of at most bucket_bytes (a bigger tensor is alone).
        element = torch.empty((), dtype=dtype).element_size()
        cuts = {m: _bucket_bounds(numels[m], self.bucket_bytes // element) for m in group.ranks}
        rounds = max(len(c) for c in cuts.values())
        for k in range(rounds):
            chunks = {}
            for m in group.ranks:
                lo, hi = cuts[m][k] if k < len(cuts[m]) else (0, 0)
                start = sum(numels[m][:lo])
                size = sum(numels[m][lo:hi])
                if m in offsets:
                    chunks[m] = buffer[offsets[m] + start : offsets[m] + start + size]
                else:
                    chunks[m] = torch.empty(size, dtype=dtype, device=device)
                if m == self.rank and size:
                    from rl3d.ops import pack_bucket

                    pack_bucket(
                        [train[p.name] for p in lists[m][lo:hi]], out=chunks[m], backend=self.kernel_backend
                    )
            self.comm.all_gather_v(group, chunks)
        return views, buffer

    # -- strategies ----------------------------------------------------------------------------
    def _gather_steps(self) -> list[tuple[Group, Callable[[int], list[ParamInfo]]]]:
        """The (group, member -> parameters it contributes) gathers of hybridflow / hybridflow_v.

        hybridflow: TP-sharded parameters over the micro-DP group; replicated norms over the
        same-TP subgroup, only when PP folds into micro-DP (s > 1). hybridflow_v: the whole
        replica over its t*p ranks, norms over the pipeline group when p > 1."""
        if self.strategy == "hybridflow":
            needed = {p.name for p in self._stage_params(self.gen.coords(self.rank).pp_g, self.gen.p_g)}
            main, norms, fold = self.groups.micro_dp, self.groups.pp_micro, self.gen.s > 1
        else:
            needed = None
            main, norms, fold = self.groups.model_parallel, self.groups.pipeline, self.train.p > 1

        def contrib(replicated: bool) -> Callable[[int], list[ParamInfo]]:
            def of(member: int) -> list[ParamInfo]:
                stage = self._stage_params(self._train_coords(member)[0], self.train.p)
                return [
                    p
                    for p in stage
                    if (needed is None or p.name in needed) and (p.kind is ShardKind.REPLICATED) == replicated
                ]

            return of

        return [(main, contrib(False))] + ([(norms, contrib(True))] if fold else [])

    def _gather_all(self, train, dtype, device, *, copy_own: bool):
        views, buffers = {}, []
        for group, contrib_of in self._gather_steps():
            got, buf = self._gather(group, contrib_of, train, copy_own=copy_own, dtype=dtype, device=device)
            views.update(got)
            buffers += [buf] if buf is not None else []
        return views, buffers

    def _hybridflow(self, train: dict[str, torch.Tensor], dtype, device) -> GenerationWeights:
        gen, me = self.gen, self.rank
        c = gen.coords(me)
        my_tp = self._train_coords(me)[1]
        views, buffers = self._gather_all(train, dtype, device, copy_own=False)
        pieces = {}
        for p in self._stage_params(c.pp_g, gen.p_g):
            stage = stages_of(p, self.spec.num_layers, self.train.p)[0]
            tps = [my_tp] if p.kind is ShardKind.REPLICATED else range(c.tp_g * gen.r, (c.tp_g + 1) * gen.r)
            holders = [self.train.rank_of(pp=stage, dp=c.dp, tp=i) for i in tps]
            pieces[p.name] = [train[p.name] if h == me else views[(h, p.name)] for h in holders]
        return self._weights(pieces, {}, buffers, c.tp_g)

    def _hybridflow_v(self, train, dtype, device) -> GenerationWeights:
        views, buffers = self._gather_all(train, dtype, device, copy_own=True)
        if self.train.p == 1:  # one stage: the norms are the rank's own, copied into the separate buffer
            norms = [p for p in self.params if p.kind is ShardKind.REPLICATED]
            norm_buf = torch.cat([train[p.name].reshape(-1) for p in norms])
            cursor = 0
            for p in norms:
                views[(self.rank, p.name)] = norm_buf[cursor : cursor + p.numel].view(p.shape)
                cursor += p.numel
            buffers.append(norm_buf)
        a, c_pp = _vanilla_gen_coords(self.groups, self.rank)
        dp = self.train.coords(self.rank).dp
        pieces = {}
        for p in self._stage_params(c_pp, self.gen.p_g):
            stage = stages_of(p, self.spec.num_layers, self.train.p)[0]
            tps = (
                [self._train_coords(self.rank)[1]]
                if p.kind is ShardKind.REPLICATED
                else range(a * self.gen.r, (a + 1) * self.gen.r)
            )
            pieces[p.name] = [views[(self.train.rank_of(pp=stage, dp=dp, tp=i), p.name)] for i in tps]
        return self._weights(pieces, {}, buffers, a)

    def _ds_chat(self, zero: dict[str, torch.Tensor], dtype, device) -> GenerationWeights:
        group, n = self.groups.world, self.train.world_size
        params = self._stage_params(0, 1)
        full, buffers = {}, []
        for p in params:  # ZeRO-3 gathers parameter by parameter
            chunk = -(-p.numel // n)
            buf = torch.empty(n * chunk, dtype=dtype, device=device)
            chunks = {m: buf[i * chunk : (i + 1) * chunk] for i, m in enumerate(group.ranks)}
            chunks[self.rank].copy_(zero[p.name])
            self.comm.all_gather_v(group, chunks)
            full[p.name] = buf[: p.numel].view(p.shape)
            buffers.append(buf)
        a, c_pp = _vanilla_gen_coords(self.groups, self.rank)
        needed = {p.name for p in self._stage_params(c_pp, self.gen.p_g)}
        return self._weights({}, {k: v for k, v in full.items() if k in needed}, buffers, a)

    def _openrlhf(self, train, dtype, device) -> GenerationWeights | None:
        n, me = self.train.world_size, self.rank
        params = self._stage_params(0, 1)  # what the rollout engine loads: no pipeline copies
        replica = self.groups.model_parallel
        if me < n and self.train.coords(me).dp == 0:
            # Trainer replica 0: every shard rank 0 lacks goes to it point to point.
            gathered: dict[str, list[torch.Tensor]] = {}
            for p in params:
                stage = stages_of(p, self.spec.num_layers, self.train.p)[0]
                tps = [0] if p.kind is ShardKind.REPLICATED else range(self.train.t)
                shards = []
                for i in tps:
                    holder = self.train.rank_of(pp=stage, dp=0, tp=i)
                    if holder == 0 == me:
                        shards.append(train[p.name])
                    elif me == 0:
                        buf = torch.empty(shard_shape(p, self.train.t), dtype=dtype, device=device)
                        self.comm.recv(replica, buf, src=holder)
                        shards.append(buf)
                    elif holder == me:
                        self.comm.send(replica, train[p.name].contiguous(), dst=0)
                gathered[p.name] = shards
        if me != 0 and me < n:
            return None  # the other trainer ranks hold no generation weights
        # Rank 0 broadcasts full tensors, bucket by bucket; each rollout rank keeps its shard.
        group = self.groups.rollout_broadcast
        mirror = me - n if me >= n else 0
        c = self.gen.coords(mirror)
        keep = {p.name for p in self._stage_params(c.pp_g, self.gen.p_g)}
        pieces = {}
        numels = [p.numel for p in params]
        element = torch.empty((), dtype=dtype).element_size()
        for lo, hi in _bucket_bounds(numels, self.bucket_bytes // element):
            bucket = torch.empty(sum(numels[lo:hi]), dtype=dtype, device=device)
            if me == 0:
                from rl3d.ops import pack_bucket

                fulls = [merge_tp_shards(gathered[p.name], p.kind) for p in params[lo:hi]]
                pack_bucket(fulls, out=bucket, backend=self.kernel_backend)
            self.comm.broadcast(group, bucket, src=0)
            if me >= n:
                cursor = 0
                for p in params[lo:hi]:
                    if p.name in keep:
                        full = bucket[cursor : cursor + p.numel].view(p.shape)
                        pieces[p.name] = [shard_for_tp(full, p.kind, self.gen.t_g, c.tp_g).clone()]
                    cursor += p.numel
        if me == 0:
            return None
        return self._weights(
            pieces, {}, [t for v in pieces.values() for t in v], c.tp_g, gen_tp_as_train=True
        )

    # -- the physical limit --------------------------------------------------------------------
    def raw_transfer(self) -> int:
        """Move the same bytes over the same groups with one flat collective per group (no
        buckets, no packing, no layout): what the fabric does at best. Returns bytes received."""
        dtype, device = self.dtype, self.device
        comm = CountedComm(self.rank, self.groups.timeout_s)
        n, me = self.train.world_size, self.rank

        def flat(numel: int) -> torch.Tensor:
            return torch.empty(numel, dtype=dtype, device=device)

        def shard_numel(p: ParamInfo) -> int:
            return p.numel if p.kind is ShardKind.REPLICATED else p.numel // self.train.t

        if self.strategy in ("hybridflow", "hybridflow_v") and me < n:
            for group, contrib_of in self._gather_steps():
                sizes = {m: sum(shard_numel(p) for p in contrib_of(m)) for m in group.ranks}
                comm.all_gather_v(group, {m: flat(k) for m, k in sizes.items()})
        elif self.strategy == "ds_chat" and me < n:
            chunk = sum(-(-p.numel // n) for p in self._stage_params(0, 1))
            comm.all_gather_v(self.groups.world, {m: flat(chunk) for m in self.groups.world.ranks})
        elif self.strategy == "openrlhf":
            params = self._stage_params(0, 1)
            if me < n and self.train.coords(me).dp == 0:
                replica = self.groups.model_parallel
                held = dict.fromkeys(replica.ranks, 0)
                for p in params:
                    stage = stages_of(p, self.spec.num_layers, self.train.p)[0]
                    for i in [0] if p.kind is ShardKind.REPLICATED else range(self.train.t):
                        held[self.train.rank_of(pp=stage, dp=0, tp=i)] += shard_numel(p)
                for src in replica.ranks:
                    if src != 0 and me == src:
                        comm.send(replica, flat(held[src]), dst=0)
                    elif src != 0 and me == 0:
                        comm.recv(replica, flat(held[src]), src=src)
            if me == 0 or me >= n:
                comm.broadcast(self.groups.rollout_broadcast, flat(sum(p.numel for p in params)), src=0)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return comm.counter.recv_bytes

    def _weights(
        self, pieces, full, buffers, gen_tp_rank, gen_tp_as_train: bool = False
    ) -> GenerationWeights:
        return GenerationWeights(
            spec=self.spec,
            params=self.by_name,
            train_tp=self.gen.t_g if gen_tp_as_train else self.train.t,
            gen_tp=self.gen.t_g,
            gen_tp_rank=gen_tp_rank,
            pieces=pieces,
            full=full,
            buffers=buffers,
        )

    # -- entry point ---------------------------------------------------------------------------
    def to_generation(
        self, train: dict[str, torch.Tensor], *, zero_shards: dict[str, torch.Tensor] | None = None
    ) -> GenerationWeights | None:
        """Build this rank's generation weights (collective: every rank calls it).

        `train` maps global parameter names to this rank's training shards (empty on openrlhf's
        rollout ranks); ds_chat takes the ZeRO-3 partition as `zero_shards`. Returns None on
        ranks that end up with no generation weights (openrlhf's trainer ranks)."""
        for name, t in (zero_shards or train).items():
            if t.dtype != self.dtype or t.device != self.device:
                raise ReshardError(
                    f"rank {self.rank}: {name} is {t.dtype} on {t.device}, "
                    f"expected {self.dtype} on {self.device}"
                )
        dtype, device = self.dtype, self.device
        self.comm.counter.reset()
        if self.rank >= self.train.world_size and self.strategy != "openrlhf":
            self.last_stats = TransitionStats(self.strategy, 0, 0, 0, 0.0, False)
            return None  # a rollout-only rank (openrlhf's world) has no part in this strategy
        start = time.perf_counter()
        if self.strategy == "hybridflow":
            weights = self._hybridflow(train, dtype, device)
        elif self.strategy == "hybridflow_v":
            weights = self._hybridflow_v(train, dtype, device)
        elif self.strategy == "ds_chat":
            if zero_shards is None:
                raise ValueError("ds_chat needs zero_shards (the ZeRO-3 partition of the weights)")
            weights = self._ds_chat(zero_shards, dtype, device)
        elif self.strategy == "openrlhf":
            weights = self._openrlhf(train, dtype, device)
        else:
            raise ValueError(f"unknown strategy {self.strategy!r}")
        if device.type == "cuda":
            torch.cuda.synchronize(device)
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
        )
        return weights

    def _gather_full_model(self, train, zero_shards) -> dict[str, torch.Tensor]:
        """The full model on every rank via all_gather_object (slow; verification only)."""
        import torch.distributed as dist

        if zero_shards is not None:
            mine = ("zero", self.rank, {k: v.cpu() for k, v in zero_shards.items()})
        elif self.rank < self.train.world_size and self.train.coords(self.rank).dp == 0:
            mine = ("tp", self.train.coords(self.rank).tp, {k: v.cpu() for k, v in train.items()})
        else:
            mine = ("none", 0, {})
        group = None if self.strategy == "openrlhf" else self.groups.world
        size = dist.get_world_size() if group is None else group.size
        everyone: list = [None] * size
        dist.all_gather_object(everyone, mine, group=None if group is None else group.handle)
        full = {}
        for p in self.params:
            if p.kind is ShardKind.REPLICATED or zero_shards is not None:
                chunks = [(i, d[p.name]) for kind, i, d in everyone if p.name in d]
            else:
                chunks = sorted((i, d[p.name]) for kind, i, d in everyone if kind == "tp" and p.name in d)
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


def _bucket_bounds(numels: list[int], bucket_elems: int) -> list[tuple[int, int]]:
    """Consecutive [lo, hi) index ranges whose element counts stay within `bucket_elems`."""
    bounds, lo, size = [], 0, 0
    for i, n in enumerate(numels):
        if i > lo and size + n > bucket_elems:
            bounds.append((lo, i))
            lo, size = i, 0
        size += n
    if lo < len(numels):
        bounds.append((lo, len(numels)))
    return bounds


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
