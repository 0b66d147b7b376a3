"""The 3D-HybridEngine planner: exact per-rank transition costs, from shapes alone.

Pure Python (no torch.distributed, no tensors), so a 70B model on 128 GPUs plans on a laptop.
A strategy (see `rl3d.hybrid_engine.strategy`) plans a transition as a list of `Collective`s
that name, for every group, the pieces each member sends. The bytes a rank receives and sends
are derived from those collectives alone, and the executor moves exactly those pieces, so
the bytes it counts equal the planned bytes by construction, not by keeping two models in step.

Definitions (the fields of the JSON contract):
- comm bytes: bytes a rank receives during the transition.
- peak_param_bytes: the generation weights a rank holds once the transition is done (for
  hybridflow this includes the training shard, reused in place). The max over ranks is
  reported; the executor measures the same quantity from storages.
- redundant_bytes: training-weight bytes a rank keeps in storage that is not its generation
  weights (0 for hybridflow, whose generation shard reuses the training shard in place).
- identity: t_g = t and p_g = p (d_g = 1), every rank's generation shard is its training
  shard. hybridflow plans no collective at all, and its generation weights are the training
  tensors themselves (peak_param_bytes is the training shard, no byte of it new).

Peak and redundant bytes use per-tensor segment accounting (see `params.SegmentTable`), so
that replicated KV groups (more TP ranks than KV heads) are counted once.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Container
from dataclasses import dataclass, field
from math import lcm
from statistics import mean

from rl3d.hybrid_engine.nodes import LinkBytes, NodeMap, link_bytes
from rl3d.hybrid_engine.params import ParamInfo, SegmentTable, model_params, stages_of
from rl3d.hybrid_engine.registry import STRATEGIES, get_strategy
from rl3d.models.params import expert_owner
from rl3d.models.spec import ModelSpec
from rl3d.parallel import GenerationLayout, ParallelLayout
from rl3d.parallel.layout import EP1_DRIFT
from rl3d.parallel.sharding import ShardKind
from rl3d.utils.dtypes import DTYPE_BYTES

UNITS = ("shard", "zero_chunk", "full")


@dataclass(frozen=True)
class RankCost:
    rank: int  # for openrlhf, ranks >= world size are the rollout GPUs
    recv_bytes: int
    send_bytes: int
    peak_param_bytes: int
    redundant_bytes: int


@dataclass(frozen=True)
class Collective:
    """One collective, run at once over disjoint groups of ranks.

    `contributions[k][m]` are the indices (into the plan's parameter list) of the pieces member
    m of `groups[k]` sends, in the order it packs them. A piece is the member's training TP
    shard (`unit="shard"`), its ZeRO-3 chunk (`"zero_chunk"`) or the whole tensor (`"full"`).
    `op` says who receives: every member (all_gather), or only the group's first rank
    (gather), or every member but the first, which sends (broadcast). `group_kind` names the
    `HybridGroups` field whose process group the executor runs it on."""

    op: str  # all_gather | gather | broadcast
    group_kind: str
    unit: str
    groups: list[list[int]]
    contributions: list[dict[int, tuple[int, ...]]]
    _member_of: dict[int, int] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        assert self.op in ("all_gather", "gather", "broadcast") and self.unit in UNITS, self
        assert len(self.groups) == len(self.contributions), "one contribution map per group"
        for k, group in enumerate(self.groups):
            for m in group:
                self._member_of[m] = k

    def group_of(self, rank: int) -> tuple[list[int], dict[int, tuple[int, ...]]] | None:
        """(ranks, member -> piece indices) of the group `rank` is in, or None."""
        k = self._member_of.get(rank)
        return None if k is None else (self.groups[k], self.contributions[k])

    def receivers(self, group: list[int]) -> list[int]:
        if self.op == "all_gather":
            return group
        return group[:1] if self.op == "gather" else group[1:]


@dataclass(frozen=True)
class Transfer:
    """Point to point: `src` sends `dst` the pieces `(holder, param index)` in one message.

    A piece is `holder`'s training shard (`unit="shard"`): `src` either is the holder or got
    the piece in an earlier phase (a node's fetcher relaying what it fetched to its node-mates).
    Or (`unit="slice"`, an expert trained at etp != t) the part of the holder's expert TP shard
    that `dst`'s generation TP shard covers (`slice_parts`), sent by the holder itself."""

    src: int
    dst: int
    unit: str
    pieces: tuple[tuple[int, int], ...]


def expert_parts(train: ParallelLayout, t_g: int) -> int:
    """How many parts an expert is cut into so that both its expert TP shards (of etp) and its
    generation TP shards (of t_g) are runs of whole parts: lcm(etp, t_g), a divisor of t."""
    return lcm(train.expert_t, t_g)


def slice_parts(train: ParallelLayout, t_g: int, etp_rank: int, tp_g: int) -> range:
    """The parts (of `expert_parts`) that expert TP shard `etp_rank` and generation TP shard
    `tp_g` share: what a holder of the first sends a rank generating with the second."""
    n = expert_parts(train, t_g)
    per_train, per_gen = n // train.expert_t, n // t_g
    lo = max(etp_rank * per_train, tp_g * per_gen)
    hi = min((etp_rank + 1) * per_train, (tp_g + 1) * per_gen)
    return range(lo, max(lo, hi))


def piece_key(index: int, replicated: bool, holder_tp: int) -> tuple[int, int]:
    """What identifies a piece's bytes: every holder of the same key holds the same values."""
    return (index, -1 if replicated else holder_tp)


@dataclass(frozen=True)
class StrategyPlan:
    strategy: str
    d_g: int
    ranks: list[RankCost]
    collectives: list[Collective]
    # point-to-point phases run after the collectives, one phase after another (hierarchical gather)
    phases: tuple[tuple[Transfer, ...], ...] = ()
    links: dict | None = None  # LinkBytes.to_json() on the strategy's nodes, where it plans them

    @property
    def comm_bytes_max(self) -> int:
        return max(r.recv_bytes for r in self.ranks)

    @property
    def comm_bytes_mean(self) -> float:
        return mean(r.recv_bytes for r in self.ranks)

    @property
    def peak_param_bytes(self) -> int:
        return max(r.peak_param_bytes for r in self.ranks)

    @property
    def redundant_bytes(self) -> int:
        return max(r.redundant_bytes for r in self.ranks)

    def summary(self) -> dict:
        return {
            "strategy": self.strategy,
            "d_g": self.d_g,
            "comm_bytes_max": self.comm_bytes_max,
            "comm_bytes_mean": self.comm_bytes_mean,
            "send_bytes_max": max(r.send_bytes for r in self.ranks),
            "peak_param_bytes": self.peak_param_bytes,
            "redundant_bytes": self.redundant_bytes,
            "num_ranks": len(self.ranks),
            **({"links": self.links} if self.links is not None else {}),
        }


@dataclass
class PlanContext:
    """What every strategy plans over: the layouts, the parameter list and its segments."""

    spec: ModelSpec
    gen: GenerationLayout
    dtype_bytes: int
    params: list[ParamInfo]
    table: SegmentTable
    nodes: NodeMap | None = None  # the caller's nodes (hierarchical strategies); None: 8 per node
    _cache: dict = field(default_factory=dict)

    @property
    def train(self) -> ParallelLayout:
        return self.gen.train

    def holding(
        self, pp_rank: int, pp_size: int, tp_rank: int, tp_size: int, ep_rank: int | None = None
    ) -> frozenset[int]:
        """Segments held by the (pp_rank, tp_rank) shard of a pp_size x tp_size layout: every
        expert of the stage, or (`ep_rank`) only the training EP rank's."""
        key = (pp_rank, pp_size, tp_rank, tp_size, ep_rank)
        if key not in self._cache:
            segs: set[int] = set()
            for i in self.stage_params(pp_rank, pp_size):
                if ep_rank is None or self.expert_rank(i) in (None, ep_rank):
                    segs.update(self.table.shard(i, tp_rank, tp_size))
            self._cache[key] = frozenset(segs)
        return self._cache[key]

    def expert_rank(self, index: int) -> int | None:
        """The training EP rank holding parameter `index` (None: not an expert's, every rank)."""
        expert = self.params[index].expert
        return None if expert is None else expert_owner(self.spec, expert, self.train.ep)[0]

    def stage_params(self, pp_rank: int, pp_size: int) -> tuple[int, ...]:
        """Indices of the parameters pipeline stage `pp_rank` of `pp_size` holds."""
        key = ("stage", pp_rank, pp_size)
        if key not in self._cache:
            layers = self.spec.num_layers
            self._cache[key] = tuple(
                i for i, p in enumerate(self.params) if pp_rank in stages_of(p, layers, pp_size)
            )
        return self._cache[key]

    def train_params(self, rank: int) -> tuple[int, ...]:
        """Indices of the parameters training rank `rank` holds: its stage's, of the experts
        only its EP rank's."""
        c = self.train.coords(rank)
        if self.train.ep == 1:
            return self.stage_params(c.pp, self.train.p)
        key = ("train", c.pp, c.ep)
        if key not in self._cache:
            stage = self.stage_params(c.pp, self.train.p)
            self._cache[key] = tuple(i for i in stage if self.expert_rank(i) in (None, c.ep))
        return self._cache[key]

    def gen_params(self, rank: int) -> tuple[int, ...]:
        return self.stage_params(self.gen.coords(rank).pp_g, self.gen.p_g)

    def replicated(self, index: int) -> bool:
        return self.params[index].kind is ShardKind.REPLICATED

    def train_segs(self, rank: int) -> frozenset[int]:
        c = self.train.coords(rank)
        if self.train.etp is None:
            return self.holding(c.pp, self.train.p, c.tp, self.train.t, c.ep if self.train.ep > 1 else None)
        key = ("train_segs", c.pp, c.tp, c.ep, c.etp)  # experts: the (ep, etp) shard
        if key not in self._cache:
            segs: set[int] = set()
            for i in self.train_params(rank):
                tp, size = self.split_of(i, rank)
                segs.update(self.table.shard(i, tp, size))
            self._cache[key] = frozenset(segs)
        return self._cache[key]

    def split_of(self, index: int, rank: int) -> tuple[int, int]:
        """(TP rank, TP size) of training rank `rank`'s shard of parameter `index`: an expert's
        over the expert TP group, every other one's over TP (megatron order: both fastest)."""
        if self.params[index].expert is not None and self.train.etp is not None:
            return rank % self.train.expert_t, self.train.expert_t
        return rank % self.train.t, self.train.t

    def gen_segs(self, rank: int) -> frozenset[int]:
        c = self.gen.coords(rank)
        return self.holding(c.pp_g, self.gen.p_g, c.tp_g, self.gen.t_g)

    def nbytes(self, segs) -> int:
        return self.table.nbytes(segs, self.dtype_bytes)

    def piece_bytes(self, unit: str, index: int, member: int, dst: int | None = None) -> int:
        if unit == "slice":  # the part of member's expert shard that dst generates with
            etp, tp_g = member % self.train.expert_t, (dst % self.train.t) // self.gen.r
            key = ("slice", index, etp, tp_g)
            if key not in self._cache:
                held = set(self.table.shard(index, etp, self.train.expert_t))
                self._cache[key] = self.nbytes(held & set(self.table.shard(index, tp_g, self.gen.t_g)))
            return self._cache[key]
        if unit == "shard":
            tp, size = self.split_of(index, member)
            key = ("shard", index, tp, size)
            if key not in self._cache:
                self._cache[key] = self.nbytes(self.table.shard(index, tp, size))
            return self._cache[key]
        numel = self.params[index].numel
        if unit == "zero_chunk":
            numel = -(-numel // self.train.world_size)
        return numel * self.dtype_bytes

    def traffic(
        self, collectives: list[Collective], phases: tuple[tuple[Transfer, ...], ...] = ()
    ) -> tuple[dict[int, int], dict[int, int]]:
        """(received, sent) bytes per rank when `collectives` and then `phases` run: the
        executor's own count."""
        return rank_traffic(self.pair_traffic(collectives, phases))

    def pair_traffic(
        self, collectives: list[Collective], phases: tuple[tuple[Transfer, ...], ...] = ()
    ) -> dict[tuple[int, int], int]:
        """{(sender, receiver): bytes}: logical traffic, what each receiver gets from each sender."""
        pairs: dict[tuple[int, int], int] = defaultdict(int)
        for c in collectives:
            for group, contrib in zip(c.groups, c.contributions):
                out = {m: sum(self.piece_bytes(c.unit, i, m) for i in contrib.get(m, ())) for m in group}
                for dst in c.receivers(group):
                    for src in group:
                        if src != dst and out[src]:
                            pairs[(src, dst)] += out[src]
        shard_bytes: dict[tuple[int, int], int] = {}  # (index, tp): a large hierarchical plan's hot path
        for phase in phases:
            for t in phase:
                if t.unit == "slice":  # sent by the holder: one (etp rank, generation TP rank) pair
                    pairs[(t.src, t.dst)] += sum(
                        self.piece_bytes("slice", i, t.src, t.dst) for _, i in t.pieces
                    )
                    continue
                if t.unit != "shard":
                    pairs[(t.src, t.dst)] += sum(self.piece_bytes(t.unit, i, h) for h, i in t.pieces)
                    continue
                total = 0
                for h, i in t.pieces:
                    nbytes = shard_bytes.get((i, h % self.train.t))
                    if nbytes is None:
                        nbytes = shard_bytes[(i, h % self.train.t)] = self.piece_bytes("shard", i, h)
                    total += nbytes
                pairs[(t.src, t.dst)] += total
        return dict(pairs)


def bucket_bounds(numels: list[int], bucket_elems: int) -> list[tuple[int, int]]:
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


def rank_traffic(pairs: dict[tuple[int, int], int]) -> tuple[dict[int, int], dict[int, int]]:
    """(received, sent) bytes per rank of {(sender, receiver): bytes}."""
    recv: dict[int, int] = defaultdict(int)
    send: dict[int, int] = defaultdict(int)
    for (src, dst), nbytes in pairs.items():
        recv[dst] += nbytes
        send[src] += nbytes
    return recv, send


def shard_contributions(
    ctx: PlanContext, groups: list[list[int]], wanted_of: Callable[[list[int]], Container[int]]
) -> list[dict[int, tuple[int, ...]]]:
    """Per group, each member's training shards among the indices `wanted_of(group)`."""
    out = []
    for group in groups:
        wanted = wanted_of(group)
        out.append({m: tuple(i for i in ctx.train_params(m) if i in wanted) for m in group})
    return out


@dataclass
class TransitionPlan:
    spec: ModelSpec
    gen: GenerationLayout
    dtype_bytes: int
    params: list[ParamInfo]
    strategies: dict[str, StrategyPlan]
    _ctx: PlanContext

    @property
    def train(self) -> ParallelLayout:
        return self.gen.train

    @property
    def model_bytes(self) -> int:
        """M: the training inventory's bytes, one replica (vocab padded, no pipeline copies)."""
        unpiped = [p for p in self.params if stages_of(p, self.spec.num_layers, 1)]
        return sum(p.numel for p in unpiped) * self.dtype_bytes

    def train_shards(self, rank: int) -> list[tuple[str, int, int]]:
        """(param name, tp rank, tp size) of every training shard `rank` holds."""
        return [(self.params[i].name, *self._ctx.split_of(i, rank)) for i in self._ctx.train_params(rank)]

    def gen_shards(self, rank: int) -> list[tuple[str, int, int]]:
        """(param name, generation tp rank, t_g) of every generation shard `rank` needs."""
        c = self.gen.coords(rank)
        return [(self.params[i].name, c.tp_g, self.gen.t_g) for i in self._ctx.gen_params(rank)]

    def rank_bytes(self, rank: int) -> tuple[int, int]:
        """(training shard bytes, generation shard bytes) of a rank."""
        return self._ctx.nbytes(self._ctx.train_segs(rank)), self._ctx.nbytes(self._ctx.gen_segs(rank))

    def link_bytes(self, strategy: str, nodes: NodeMap) -> LinkBytes:
        """The bytes `strategy`'s plan moves over each link when ranks sit on `nodes`."""
        s = self.strategies[strategy]
        return link_bytes(self._ctx.pair_traffic(s.collectives, s.phases), nodes)

    def pair_bytes(self, strategy: str) -> dict[tuple[int, int], int]:
        s = self.strategies[strategy]
        return self._ctx.pair_traffic(s.collectives, s.phases)

    def traffic(self, collectives: list[Collective]) -> tuple[dict[int, int], dict[int, int]]:
        """(received, sent) bytes per rank of some of a plan's collectives, run alone."""
        return self._ctx.traffic(collectives)

    def phase_pair_bytes(self, phase: tuple[Transfer, ...]) -> dict[tuple[int, int], int]:
        """{(sender, receiver): bytes} of one point-to-point phase of a plan."""
        return self._ctx.pair_traffic([], (phase,))

    def to_json(self) -> dict:
        return {
            "model": self.spec.name,
            "dtype_bytes": self.dtype_bytes,
            "train": {"p": self.train.p, "t": self.train.t, "d": self.train.d},
            "gen": {"p_g": self.gen.p_g, "t_g": self.gen.t_g, "d_g": self.gen.d_g, "d": self.train.d},
            "world_size": self.train.world_size,
            "d_g": self.gen.d_g,
            "identity": self.gen.is_identity,
            "model_bytes": self.model_bytes,
            "strategies": {name: s.summary() for name, s in self.strategies.items()},
        }


def plan_transition(
    spec: ModelSpec,
    train: ParallelLayout,
    t_g: int,
    p_g: int = 1,
    *,
    dtype: str = "bfloat16",
    strategies: tuple[str, ...] | None = None,
    params: list[ParamInfo] | None = None,
    nodes: NodeMap | None = None,
) -> TransitionPlan:
    """Plan the train -> generate transition with the given strategies (default: every one
    registered that plans the layout: with expert parallelism, those that `supports_ep`).
    `nodes` groups ranks into nodes for the strategies that plan per node (the hierarchical
    gather); the others ignore it. Raises ValueError on an impossible layout, an unknown
    strategy (or one that cannot plan expert parallelism), or nodes that leave a rank out."""
    gen = GenerationLayout.from_training(train, t_g, p_g)
    if spec.num_layers % train.p:
        raise ValueError(f"pipeline size p={train.p} must divide the {spec.num_layers} layers of {spec.name}")
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPE_BYTES)}")
    if strategies is None:  # every registered one that plans this layout
        names = tuple(n for n in STRATEGIES if train.ep == 1 or STRATEGIES[n].supports_ep)
    else:
        names = strategies
    classes = {name: get_strategy(name) for name in names}
    if train.ep > 1:
        for name, cls in classes.items():
            if not cls.supports_ep:
                raise ValueError(
                    f"strategy {name} does not plan expert parallelism (actor.parallel.ep={train.ep}); "
                    f"those that do: {', '.join(n for n in STRATEGIES if STRATEGIES[n].supports_ep)}"
                )
    if train.etp is not None:
        if train.ep == 1:  # the recipe refuses it too; at ep 1 the experts would ride the dense gather
            raise ValueError(f"etp={train.etp} apart from tp={train.t} needs ep > 1: {EP1_DRIFT}")
        if set(names) != {"hybridflow"}:
            raise ValueError(
                f"hybrid_engine.strategy: only hybridflow plans actor.parallel.etp={train.etp} "
                f"apart from tp={train.t}; asked for {', '.join(names)}"
            )
    params = params if params is not None else model_params(spec, train_tp=train.t)
    if nodes is not None and not nodes.covers(range(train.world_size)):
        raise ValueError(f"nodes {nodes.to_json()} leave out some of the {train.world_size} training ranks")
    ctx = PlanContext(spec, gen, DTYPE_BYTES[dtype], params, SegmentTable(params, train.t), nodes)
    plans = {name: cls().plan(ctx) for name, cls in classes.items()}
    return TransitionPlan(spec, gen, ctx.dtype_bytes, params, plans, ctx)
