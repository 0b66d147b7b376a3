"""Training and generation layouts of the actor's ranks.

Pure Python: no torch.distributed, no megatron globals. Process groups are built from these
objects once (see `rl3d.parallel.groups`) and handed to whatever needs them.

Training layout `p-t-d` uses megatron-core's default rank order `tp-cp-ep-dp-pp` (tp fastest,
then cp, then dp, then pp):
    rank = tp + t * (cp + c * (dp + d * pp))
Context parallelism `cp` (c ranks) splits each sequence over c ranks that hold the same weights
and the same samples: for the weights they are data replicas (megatron reduces gradients over
the c*d ranks of `dp_cp_groups`), for the data one replica (`d` data-parallel ranks get samples).

Expert parallelism `ep` splits each layer's experts over `ep` ranks, each expert's fc1/fc2 tensor
parallel over `etp` ranks (default t). megatron-core decomposes each stage's t*d ranks a second
time for the experts, in its order tp-ep-dp: with L = tp + t * dp a rank's index in its stage,
    L = etp_rank + etp * (ep_rank + ep * edp)
so `etp` divides `t` (rl3d's rule: an expert's shards stay inside one dense TP group) and
`ep * etp` divides `t * d` (experts under context parallelism are not built: ep > 1 needs cp 1).
With etp = t this is dp = ep_rank + ep * edp. Dense weights stay
replicated over all `d` ranks; an expert's shard over the `t d / (etp ep)` expert-data-parallel
ranks (same ep_rank and etp_rank).

Generation layout `p_g-t_g-d_g-d` (HybridFlow, EuroSys'25, section 5.3). With r = t/t_g and
s = p/p_g, each training TP rank i = a*r + b and PP stage j = c*s + e, where a is the generation
TP rank, c the generation PP stage, and (b, e) the position inside the micro data-parallel group.
Generation TP/PP groups take ranks at stride r (s); micro-DP groups take consecutive ranks, so the
ranks of one micro-DP group together hold exactly the generation shard (a, c) they all need.
"""

from __future__ import annotations

from dataclasses import dataclass

# megatron-core 0.16 marks the experts' weights expert-parallel (their gradients averaged over
# the expert data-parallel ranks) only when ep > 1; at ep 1 the dense DP all-reduce misses
# the TP ranks that hold the same expert, and their copies drift apart.
EP1_DRIFT = (
    "megatron-core averages the experts' gradients over the ranks holding them only under expert parallelism"
)


def _check_positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class RankCoords:
    """A rank's coordinates in the training grid; `ep`, `etp`, `edp`: its expert-parallel,
    expert tensor-parallel and expert data-parallel ranks."""

    pp: int
    dp: int
    tp: int
    ep: int = 0
    etp: int = 0
    edp: int = 0
    cp: int = 0


@dataclass(frozen=True)
class ParallelLayout:
    """Megatron training layout: `p` pipeline stages x `t` tensor ranks x `d` data replicas, the
    experts of a mixture of experts split over `ep` ranks and each expert over `etp` (None: t),
    each sequence split over `cp` context-parallel ranks."""

    p: int
    t: int
    d: int
    ep: int = 1
    etp: int | None = None
    cp: int = 1

    def __post_init__(self) -> None:
        for name in ("p", "t", "d", "ep", "cp"):
            _check_positive(name, getattr(self, name))
        if self.cp > 1 and (self.ep > 1 or self.etp is not None):
            raise ValueError(
                f"experts under context parallelism are not built: cp={self.cp} needs ep 1, etp t"
            )
        if self.etp is not None:
            _check_positive("etp", self.etp)
            if self.etp == self.t:  # the default, spelled out: one layout, one equality
                object.__setattr__(self, "etp", None)
        if self.t % self.expert_t:
            raise ValueError(
                f"expert tensor parallelism etp={self.etp} must divide the tensor size t={self.t}"
            )
        if self.expert_t == self.t and self.d % self.ep:
            raise ValueError(f"expert parallelism ep={self.ep} must divide the data-parallel size d={self.d}")
        if (self.t * self.d) % (self.ep * self.expert_t):
            raise ValueError(
                f"expert parallelism ep={self.ep} x etp={self.expert_t} must divide "
                f"t x d = {self.t * self.d} (a stage's ranks)"
            )

    @property
    def expert_t(self) -> int:
        """The expert tensor-parallel size (`etp`, t unless set apart)."""
        return self.t if self.etp is None else self.etp

    @property
    def expert_d(self) -> int:
        """The expert data-parallel size: ranks holding the same expert shard, per stage."""
        return self.stage_size // (self.ep * self.expert_t)

    @property
    def stage_size(self) -> int:
        """The ranks of one pipeline stage: t * cp * d."""
        return self.t * self.cp * self.d

    @property
    def world_size(self) -> int:
        return self.p * self.t * self.cp * self.d  # spelled out: planners call it in their inner loops

    def as_data_replicas(self) -> ParallelLayout:
        """This layout with its CP ranks counted as data replicas (`p-t-(d*cp)`): the same ranks
        hold the same weight shards (rank = tp + t * (cp + c * dp + c * d * pp)), which is all a
        weight transition reads."""
        if self.cp == 1:
            return self
        return ParallelLayout(self.p, self.t, self.d * self.cp)

    def rank_of(self, *, pp: int, dp: int, tp: int, cp: int = 0) -> int:
        assert 0 <= pp < self.p and 0 <= dp < self.d and 0 <= tp < self.t and 0 <= cp < self.cp, (
            pp,
            dp,
            tp,
            cp,
        )
        return tp + self.t * (cp + self.cp * (dp + self.d * pp))

    def coords(self, rank: int) -> RankCoords:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of size {self.world_size} ({self})")
        tp = rank % self.t
        cp = (rank // self.t) % self.cp
        dp = (rank // (self.t * self.cp)) % self.d
        pp = rank // self.stage_size
        etp, rest = rank % self.expert_t, (rank % self.stage_size) // self.expert_t
        return RankCoords(pp=pp, dp=dp, tp=tp, ep=rest % self.ep, etp=etp, edp=rest // self.ep, cp=cp)

    def expert_rank_of(self, *, pp: int, edp: int, ep: int, etp: int) -> int:
        assert 0 <= edp < self.expert_d and 0 <= ep < self.ep and 0 <= etp < self.expert_t, (edp, ep, etp)
        return pp * self.stage_size + etp + self.expert_t * (ep + self.ep * edp)

    def ep_groups(self) -> list[list[int]]:
        """The `ep` ranks that split one layer's experts (with etp = t: consecutive DP indices)."""
        return [
            [self.expert_rank_of(pp=pp, edp=edp, ep=e, etp=et) for e in range(self.ep)]
            for pp in range(self.p)
            for edp in range(self.expert_d)
            for et in range(self.expert_t)
        ]

    def expert_dp_groups(self) -> list[list[int]]:
        """The ranks holding the same expert shard (their gradients are averaged)."""
        return [
            [self.expert_rank_of(pp=pp, edp=edp, ep=e, etp=et) for edp in range(self.expert_d)]
            for pp in range(self.p)
            for e in range(self.ep)
            for et in range(self.expert_t)
        ]

    def expert_tp_groups(self) -> list[list[int]]:
        """The `etp` ranks that split each of their experts (with etp = t: the TP groups)."""
        return [
            [self.expert_rank_of(pp=pp, edp=edp, ep=e, etp=et) for et in range(self.expert_t)]
            for pp in range(self.p)
            for edp in range(self.expert_d)
            for e in range(self.ep)
        ]

    def _cells(self, *axes: str) -> list[dict[str, int]]:
        """Every combination of the named axes' indices (the others vary in the groups)."""
        sizes = {"pp": self.p, "dp": self.d, "cp": self.cp, "tp": self.t}
        cells: list[dict[str, int]] = [{}]
        for axis in axes:
            cells = [{**c, axis: i} for c in cells for i in range(sizes[axis])]
        return cells

    def tp_groups(self) -> list[list[int]]:
        return [[self.rank_of(**c, tp=tp) for tp in range(self.t)] for c in self._cells("pp", "dp", "cp")]

    def cp_groups(self) -> list[list[int]]:
        """The `cp` ranks that split one sequence (ring attention runs over them)."""
        return [[self.rank_of(**c, cp=cp) for cp in range(self.cp)] for c in self._cells("pp", "dp", "tp")]

    def dp_groups(self) -> list[list[int]]:
        """The `d` ranks that get different samples (same pp, cp, tp)."""
        return [[self.rank_of(**c, dp=dp) for dp in range(self.d)] for c in self._cells("pp", "cp", "tp")]

    def dp_cp_groups(self) -> list[list[int]]:
        """The c*d ranks holding the same weight shard (gradients are reduced over them)."""
        return [
            sorted(self.rank_of(**c, dp=dp, cp=cp) for dp in range(self.d) for cp in range(self.cp))
            for c in self._cells("pp", "tp")
        ]

    def pp_groups(self) -> list[list[int]]:
        return [[self.rank_of(**c, pp=pp) for pp in range(self.p)] for c in self._cells("dp", "cp", "tp")]

    def model_parallel_groups(self) -> list[list[int]]:
        """The t*p ranks of each training replica (one DP and CP index), in rank order."""
        return [
            sorted(self.rank_of(**c, pp=pp, tp=tp) for pp in range(self.p) for tp in range(self.t))
            for c in self._cells("dp", "cp")
        ]

    def __str__(self) -> str:
        etp = f" etp={self.etp}" if self.etp is not None else ""
        cp = f" cp={self.cp}" if self.cp > 1 else ""
        return f"{self.p}-{self.t}-{self.d}" + (f" ep={self.ep}" if self.ep > 1 else "") + etp + cp


@dataclass(frozen=True)
class GenCoords:
    """A rank's coordinates in the generation grid.

    `micro_dp` is the rank's index inside its micro-DP group (e*r + b); `dp_g` is its
    generation data-parallel index over the whole world (dp * d_g + micro_dp).
    """

    pp_g: int
    tp_g: int
    micro_dp: int
    dp: int
    dp_g: int


@dataclass(frozen=True)
class GenerationLayout:
    """Generation layout `p_g-t_g-d_g-d` derived from a training layout."""

    train: ParallelLayout
    t_g: int
    p_g: int

    def __post_init__(self) -> None:
        if self.train.cp > 1:
            raise ValueError(
                f"a generation layout reads CP ranks as data replicas: build it from_training ({self.train})"
            )
        _check_positive("t_g", self.t_g)
        _check_positive("p_g", self.p_g)
        if self.train.t % self.t_g:
            raise ValueError(f"generation tensor size t_g={self.t_g} must divide training t={self.train.t}")
        if self.train.p % self.p_g:
            raise ValueError(f"generation pipeline size p_g={self.p_g} must divide training p={self.train.p}")

    @classmethod
    def from_training(cls, train: ParallelLayout, t_g: int, p_g: int = 1) -> GenerationLayout:
        """The generation layout of `train`, whose CP ranks count as data replicas (they hold the
        same weights): `train.as_data_replicas()` is this layout's `train`."""
        return cls(train=train.as_data_replicas(), t_g=t_g, p_g=p_g)

    @property
    def r(self) -> int:
        """Micro-DP factor along TP: t / t_g."""
        return self.train.t // self.t_g

    @property
    def s(self) -> int:
        """Micro-DP factor along PP: p / p_g."""
        return self.train.p // self.p_g

    @property
    def d_g(self) -> int:
        """Micro data-parallel size: (p*t) / (p_g*t_g)."""
        return self.r * self.s

    @property
    def is_identity(self) -> bool:
        """Every rank's generation shard is its training shard (t_g = t and p_g = p): the
        transition moves nothing and the engine reads the training parameters in place."""
        return self.d_g == 1

    @property
    def world_size(self) -> int:
        return self.train.world_size

    def _rank(self, *, dp: int, a: int, b: int, c: int, e: int) -> int:
        return self.train.rank_of(pp=c * self.s + e, dp=dp, tp=a * self.r + b)

    def coords(self, rank: int) -> GenCoords:
        tc = self.train.coords(rank)
        a, b = divmod(tc.tp, self.r)
        c, e = divmod(tc.pp, self.s)
        micro = e * self.r + b
        return GenCoords(pp_g=c, tp_g=a, micro_dp=micro, dp=tc.dp, dp_g=tc.dp * self.d_g + micro)

    def gen_tp_groups(self) -> list[list[int]]:
        """Ranks at stride r along TP: {a*r + b : a} for each fixed (dp, c, e, b)."""
        return [
            [self._rank(dp=dp, a=a, b=b, c=c, e=e) for a in range(self.t_g)]
            for dp in range(self.train.d)
            for c in range(self.p_g)
            for e in range(self.s)
            for b in range(self.r)
        ]

    def gen_pp_groups(self) -> list[list[int]]:
        """Stages at stride s along PP: {c*s + e : c} for each fixed (dp, e, a, b)."""
        return [
            [self._rank(dp=dp, a=a, b=b, c=c, e=e) for c in range(self.p_g)]
            for dp in range(self.train.d)
            for e in range(self.s)
            for a in range(self.t_g)
            for b in range(self.r)
        ]

    def micro_dp_groups(self) -> list[list[int]]:
        """Consecutive ranks {a*r + b : b} x {c*s + e : e} for each fixed (dp, c, a)."""
        return [
            [self._rank(dp=dp, a=a, b=b, c=c, e=e) for e in range(self.s) for b in range(self.r)]
            for dp in range(self.train.d)
            for c in range(self.p_g)
            for a in range(self.t_g)
        ]

    def expert_micro_dp_groups(self) -> list[list[int]]:
        """The micro-DP groups of one EP group's `ep` data-parallel ranks, joined (for each fixed
        (edp, c, a)): between them they hold every expert of generation shard (a, c) once, each
        member its own EP rank's experts, so one all-gather gives each member all of them. With
        ep = 1 these are the micro-DP groups. With experts trained at etp != t, generated at
        t_g = 1: the ranks of one expert-DP index and generation stage, each holding its
        (ep, etp) shard of its stage's experts; at t_g > 1 none (the experts' parts move point
        to point, see `rl3d.hybrid_engine.hybridflow`)."""
        ep, train = self.train.ep, self.train
        if train.etp is not None and self.t_g > 1:
            return []
        if train.etp is not None:  # every expert whole on each rank (t_g = 1): one holder of each
            return [
                sorted(
                    train.expert_rank_of(pp=c * self.s + e, edp=edp, ep=k, etp=j)
                    for e in range(self.s)
                    for k in range(ep)
                    for j in range(train.expert_t)
                )
                for edp in range(train.expert_d)
                for c in range(self.p_g)
            ]
        return [
            sorted(
                self._rank(dp=edp * ep + k, a=a, b=b, c=c, e=e)
                for k in range(ep)
                for e in range(self.s)
                for b in range(self.r)
            )
            for edp in range(self.train.d // ep)
            for c in range(self.p_g)
            for a in range(self.t_g)
        ]

    def gen_dp_groups(self) -> list[list[int]]:
        """All d_g*d ranks that hold the same generation shard (a, c)."""
        return [
            [
                self._rank(dp=dp, a=a, b=b, c=c, e=e)
                for dp in range(self.train.d)
                for e in range(self.s)
                for b in range(self.r)
            ]
            for c in range(self.p_g)
            for a in range(self.t_g)
        ]

    def __str__(self) -> str:
        return f"{self.p_g}-{self.t_g}-{self.d_g}-{self.train.d}"
