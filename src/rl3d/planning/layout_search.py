"""Layout search: which roles share which resource pools, in which parallel sizes.

The search (after HybridFlow's mapping algorithm, EuroSys'25 section 6) runs over
- structures: every subset of the movable role groups (critic with its cost critic, the
  reference, each learned scorer) that gets its own pool, the rest staying on the actor's, with
  or without a separate rollout pool;
- splits of the devices over the structure's pools (whole nodes once the job spans nodes);
- per pool and size, its parallel layout (p divides the layers, t the heads and KV heads and
  stays inside a node; for a mixture of experts' actor also ep, dividing d and the experts) and,
  on the actor's pool, the generation layout (t_g | t, p_g | p);
- per pool that trains (actor, critic) at t > 1, megatron's sequence parallelism on and off
  (a mixture of experts trains at t > 1 only with it), and full activation recompute for an
  option that does not fit without it. An actor layout the recipe refuses (`actor_ok`, from
  `rl3d.planning.auto_layout`) is not taken.
The stages of one pool do not depend on the other pools' layouts (the weight sync aside, which
takes the rest of the devices as the actor's), so each pool's best layout per size is found
once, splits are ranked by the sum, and the best few per structure are simulated whole. A
pool's layout that does not fit memory is taken only when none fits; such a candidate is
reported with `fits: false` and never chosen. Of a layout's ep options only the reshard's time
differs (the experts gathered over the EP group; the tokens' all-to-all is not modelled), so ep
> 1 is taken where the footprint needs it; of equally fast options the smaller footprint wins.
Sequence parallelism costs the same time as without (`rl3d.planning.simulator`), so it is taken
at t > 1 by the same rule; recompute costs a forward and is taken only to fit.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass, replace

from rl3d.models.spec import ModelSpec
from rl3d.parallel import ParallelLayout
from rl3d.planning.devices import DeviceClass
from rl3d.planning.footprint import pool_footprint
from rl3d.planning.simulator import StepEstimate, pool_stages, simulate
from rl3d.planning.workload import ROLLOUT, TRAINED, PoolLayout, RunLayout, Workload

MOVABLE = (("critic", "cost_critic"), ("reference",), ("reward_model",), ("cost_model",))
SPLITS_PER_STRUCTURE = 6


@dataclass(frozen=True)
class PoolChoice:
    """A pool's layout and how its trained roles run in it."""

    layout: ParallelLayout
    sequence_parallel: bool = False
    recompute: bool = False

    def pool(self, name: str, roles: tuple[str, ...]) -> PoolLayout:
        trained = tuple(r for r in roles if r in TRAINED)
        split = trained if self.sequence_parallel else ()
        return PoolLayout(name, self.layout, roles, split, trained if self.recompute else ())


ActorCheck = Callable[[PoolChoice], bool]


@dataclass(frozen=True)
class Candidate:
    run_layout: RunLayout
    estimate: StepEstimate


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def pool_sizes(gpus: int, device: DeviceClass) -> list[int]:
    """Sizes a pool may take: any inside one node, whole nodes once the job spans nodes."""
    if gpus <= device.gpus_per_node:
        return list(range(1, gpus + 1))
    return list(range(device.gpus_per_node, gpus + 1, device.gpus_per_node))


def compositions(total: int, parts: int, sizes: list[int]):
    """Every tuple of `parts` sizes from `sizes` that sums to `total`."""
    if parts == 1:
        if total in sizes:
            yield (total,)
        return
    for size in sizes:
        if size < total:
            for rest in compositions(total - size, parts - 1, sizes):
                yield (size, *rest)


def tp_fits(spec: ModelSpec, t: int, device: DeviceClass) -> bool:
    """Tensor parallelism inside one node, splitting heads, KV heads and the MLP evenly."""
    return t <= device.gpus_per_node and not (
        spec.num_attention_heads % t
        or spec.num_query_groups % t
        or spec.ffn_hidden_size % t
        or spec.moe_ffn_hidden_size % t
    )


def layouts(
    spec: ModelSpec, size: int, device: DeviceClass, *, experts: bool = False
) -> list[ParallelLayout]:
    """p-t-d layouts of `size` devices; with `experts` (a mixture of experts' actor) each with
    every expert parallelism ep that divides d and the experts."""
    out = []
    for t in divisors(size):
        if not tp_fits(spec, t, device):
            continue
        for p in divisors(size // t):
            if spec.num_layers % p:
                continue
            d = size // (t * p)
            eps = [ep for ep in divisors(d) if spec.num_experts % ep == 0] if experts else [1]
            out += [ParallelLayout(p, t, d, ep=ep) for ep in eps]
    return out


def structures(roles: tuple[str, ...], rollout_pool: bool) -> list[tuple[tuple[str, ...], ...]]:
    """Each structure: the role groups of its pools, the actor's first, a rollout pool last."""
    groups = [tuple(r for r in g if r in roles) for g in MOVABLE]
    groups = [g for g in groups if g]
    out = []
    for k in range(len(groups) + 1):
        for own in itertools.combinations(groups, k):
            actor = ("actor", *(r for r in roles if r != "actor" and not any(r in g for g in own)))
            base = (actor, *own)
            out.append(base)
            if rollout_pool:
                out.append((*base, (ROLLOUT,)))
    return out


def _pools(structure, choices: list[PoolChoice]) -> tuple[PoolLayout, ...]:
    return tuple(
        c.pool(ROLLOUT if roles == (ROLLOUT,) else roles[0], roles) for roles, c in zip(structure, choices)
    )


def split_options(spec: ModelSpec, roles: tuple[str, ...], t: int) -> list[bool]:
    """Sequence parallelism off and on for a pool hosting `roles` that trains at t > 1 (a
    mixture of experts trains there only with it); off elsewhere."""
    if t == 1 or not any(r in TRAINED for r in roles):
        return [False]
    return [True] if spec.is_moe else [False, True]


class Search:
    """The best layout of each pool at each size, then the best splits, per structure."""

    def __init__(
        self,
        w: Workload,
        device: DeviceClass,
        gpus: int,
        actor_ok: ActorCheck | None = None,
    ):
        self.w, self.device, self.gpus = w, device, gpus
        self.actor_ok = actor_ok
        self.sizes = pool_sizes(gpus, device)

    def _options(self, structure, index: int, size: int):
        roles = structure[index]
        if roles == (ROLLOUT,):
            for t in divisors(size):
                if tp_fits(self.w.actor, t, self.device):
                    yield PoolChoice(ParallelLayout(1, t, size // t)), 1, 1
            return
        spec = self.w.spec(roles[0])
        actor = roles[0] == "actor"
        for lay in layouts(spec, size, self.device, experts=actor and spec.is_moe):
            if not self._splits_batch(roles, lay.d):
                continue
            for split in split_options(spec, roles, lay.t):
                choice = PoolChoice(lay, split)
                if actor and self.actor_ok is not None and not self.actor_ok(choice):
                    continue
                if actor and structure[-1] != (ROLLOUT,):
                    for t_g, p_g in itertools.product(divisors(lay.t), divisors(lay.p)):
                        yield choice, t_g, p_g
                else:
                    yield choice, 1, 1

    def _splits_batch(self, roles: tuple[str, ...], dp: int) -> bool:
        """A trained role's mini-batch splits over dp ranks in whole micro-batches; a forward
        role's dp divides the step's samples."""
        w = self.w
        if any(r in ("actor", "critic") for r in roles):
            return w.mini_batch_size % (dp * w.micro_batch_size) == 0
        return w.samples % dp == 0

    @functools.cache  # noqa: B019  (one search object per query)
    def best_pool(self, structure, index: int, size: int):
        """(seconds, fits, choice, t_g, p_g, peak bytes) of the pool's best option at `size`, or
        None; of equally fast ones the smallest footprint. An option that does not fit is tried
        again with recompute."""
        best = None
        for choice, t_g, p_g in self._options(structure, index, size):
            run_layout, peak, budget, fits = self._footprint(structure, index, choice, t_g, p_g)
            again = replace(choice, recompute=True)
            if not fits and self._may_recompute(structure[index], again):
                trial = self._footprint(structure, index, again, t_g, p_g)
                if trial[3]:
                    choice, (run_layout, peak, budget, fits) = again, trial
            pool = run_layout.pools[index]
            bound = sum(
                pool_stages(self.w, run_layout, self.device, pool, budget or 0.0, transition=False).values()
            )
            if best is not None and (not fits, bound) > (not best[1], best[0]):
                continue
            seconds = sum(pool_stages(self.w, run_layout, self.device, pool, budget or 0.0).values())
            if best is None or (not fits, seconds, peak) < (not best[1], best[0], best[5]):
                best = (seconds, fits, choice, t_g, p_g, peak)
        return best

    def _footprint(self, structure, index: int, choice: PoolChoice, t_g: int, p_g: int):
        """(run layout, peak bytes, KV budget, fits) of the pool `index` in `choice`, the other
        pools filling the rest of the devices."""
        others = self.gpus - choice.layout.world_size
        filler = [
            PoolChoice(ParallelLayout(1, 1, max(others, 1)) if i == 0 else ParallelLayout(1, 1, 1))
            for i in range(len(structure))
        ]
        filler[index] = choice
        run_layout = RunLayout(pools=_pools(structure, filler), t_g=t_g, p_g=p_g)
        peak, budget = pool_footprint(self.w, run_layout, self.device, run_layout.pools[index])
        fits = peak <= self.device.memory_gb * 1e9 and (budget is None or budget >= 0)
        return run_layout, peak, budget, fits

    def _may_recompute(self, roles: tuple[str, ...], choice: PoolChoice) -> bool:
        if not any(r in TRAINED for r in roles):
            return False
        return roles[0] != "actor" or self.actor_ok is None or self.actor_ok(choice)

    def splits(self, structure):
        k = len(structure)
        ranked = []
        for sizes in compositions(self.gpus, k, self.sizes):
            parts = [self.best_pool(structure, i, s) for i, s in enumerate(sizes)]
            if any(p is None for p in parts):
                continue
            ranked.append(((not all(p[1] for p in parts), sum(p[0] for p in parts)), parts))
        ranked.sort(key=lambda r: r[0])
        return [parts for _, parts in ranked[:SPLITS_PER_STRUCTURE]]

    def candidates(self, rollout_pool: bool = True) -> list[Candidate]:
        out = []
        for structure in structures(self.w.roles, rollout_pool):
            if len(structure) > self.gpus:
                continue
            for parts in self.splits(structure):
                actor = parts[0]
                run_layout = RunLayout(
                    pools=_pools(structure, [p[2] for p in parts]), t_g=actor[3], p_g=actor[4]
                )
                out.append(Candidate(run_layout, simulate(self.w, run_layout, self.device)))
        out.sort(key=lambda c: (not c.estimate.fits, c.estimate.step_seconds))
        return out


def search_run_layouts(
    w: Workload,
    device: DeviceClass,
    gpus: int,
    *,
    rollout_pool: bool = True,
    actor_ok: ActorCheck | None = None,
) -> list[Candidate]:
    """Every structure's best few run layouts on `gpus` devices, fastest fitting first;
    `actor_ok(choice)` False: the actor may not train in that layout (with that sequence
    parallelism and recompute)."""
    if gpus < 1:
        raise ValueError(f"--gpus must be >= 1, got {gpus}")
    return Search(w, device, gpus, actor_ok).candidates(rollout_pool)
