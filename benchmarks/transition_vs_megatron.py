"""rl3d's transition against megatron-core's own resharding (`megatron.core.resharding`), on the
same layouts and the same training weights, in one gloo world.

    python benchmarks/transition_vs_megatron.py                   # the committed run (about 10 min)
    python benchmarks/transition_vs_megatron.py --models tiny-llama --layouts 1-2-2:1 \
        --repeats 1 --warmup 0 --out /tmp/tvm                     # the smallest check

Layouts are `--layouts P-T-D:TG[:PG]`; a model's layouts of one world size p*t*d run one after
another in one spawned gloo world of that many ranks. For each layout every rank builds its
shard of a real megatron-core GPTModel in the training layout (`build_gpt`, the weights cut from
one seeded full model), then moves it into the generation layout three ways, alternating run by
run:

- `rl3d`: `Resharder.to_generation` (hybridflow) on the training model's own tensors;
- `megatron_rl3d_groups`: `megatron.core.resharding.swap_model_weights(src, dst, GlooCopyService())`
  into a second GPTModel built with rl3d's generation TP/PP/DP groups. Megatron's planner takes a
  replicated or TP-sharded weight from the holder that `dst_rank % holders` picks among its
  training DP groups; given each training rank as its own DP group (for planning only), that is
  the holder with the receiver's own TP rank and DP replica, the one rl3d takes;
- `megatron_default`: the same call into a GPTModel on megatron's default rank order for the
  generation sizes (tp fastest, then dp, then pp), planned with the training model's own groups.

Megatron plans once (`build_centralized_reshard_plan`, cached on the target as
`reshard_model_weights` caches it) and rl3d once (`Resharder(...)`); both plan times are
reported, the timed runs execute only. Per side: bytes received and sent and messages received
per rank (megatron's from its plan's remote operations, rl3d's counted by its executor), the
slowest rank's seconds (median of the runs after warm-up) and the CPU-seconds all ranks spent
(user + system, gloo's threads too: on a shared, oversubscribed CPU the work, where the wall
time also measures the scheduler), the memory each side allocates beyond the training weights
(kept: rl3d's generation buffers, megatron's target model; peak: kept plus what the call
allocates on its thread, `AllocationTracker`; the rise of the process's RSS high-water mark as a
cross-check that also sees gloo's own buffers), and whether the generation weights are right:
rl3d's equal the full model's slices, megatron's equal rl3d's bit for bit (default groups: the
full model's slices for the ranks' own coordinates). rl3d's phases
(`Resharder(time_phases=True)`, rank mean) and the cost of materializing one Megatron tensor per
parameter (`GenerationWeights.materialize`, what megatron's target holds; rl3d's own engine
reads the pieces in place) are reported too.

CPU shim, here and nowhere else: `GlooCopyService` makes a `torch.cuda.Stream` and waits on it;
on a machine without CUDA its module sees a torch whose `cuda.Stream()` is None, which `run()`
already treats as "no stream to wait on".

Results go to --out: result.json, transition_vs_megatron.csv, .md and .png. The run fails (exit
1, after writing them) if megatron given rl3d's groups moves other bytes than rl3d on any rank,
or any generation weight differs.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import re
import statistics
import sys
import time
import weakref
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from rl3d.hybrid_engine.stats import PHASES

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "benchmarks" / "transition_vs_megatron"
MODELS = "tiny-llama,llama3-8b-shape-1/16"
# t_g < t, t_g = t (identity), t_g < t with t = 4, PP folding into micro-DP, both folding with d = 2
LAYOUTS = "1-2-2:1,1-2-2:2,1-4-1:2,2-2-1:2,2-2-2:1"
SIDES = ("rl3d", "megatron_rl3d_groups", "megatron_default")

MB = 1e6


def parse_layout(text: str) -> tuple[tuple[int, ...], int, int]:
    """'P-T-D[eEP]:TG[:PG]' -> ((p, t, d[, ep]), t_g, p_g); `1-1-2e2:1`: experts over ep 2."""
    train, _, gen = text.partition(":")
    train, _, ep = train.partition("e")
    p, t, d = (int(x) for x in train.split("-"))
    t_g, _, p_g = gen.partition(":")
    return ((p, t, d, int(ep)) if ep else (p, t, d)), int(t_g), int(p_g or 1)


def layout_name(layout: tuple[int, ...]) -> str:
    return "-".join(map(str, layout[:3])) + (f" ep{layout[3]}" if len(layout) > 3 else "")


# -- the CPU shim for megatron's gloo copy service --------------------------------------------------
class _TorchWithoutCuda:
    """torch, except that `cuda.Stream()` is None (what `GlooCopyService` asks of CUDA)."""

    class cuda:  # noqa: N801  (stands in for the module)
        @staticmethod
        def Stream():  # noqa: N802
            return None

    def __getattr__(self, name):
        return getattr(torch, name)


def shim_gloo_copy_service() -> None:
    from megatron.core.resharding.copy_services import gloo_copy_service

    if not torch.cuda.is_available():
        gloo_copy_service.torch = _TorchWithoutCuda()


# -- the benchmark's one patch of megatron's planner: SequentialMLP's expert names ------------------
def shim_sequential_expert_names() -> None:
    """megatron-core 0.16.1's planner finds an expert's index under expert parallelism only in
    TEGroupedMLP's names (`experts.linear_fc1.weight3`, remapped from the rank's local index to the
    global one); rl3d's CPU models are megatron's SequentialMLP (`experts.local_experts.3.
    linear_fc1.weight`), whose local index it would match across ranks as if global. This teaches
    its name resolution that form too, the same arithmetic; planning and execution are untouched."""
    from megatron.core.resharding import utils

    original = utils.assign_ep_resolved_name_inplace
    local = re.compile(r"\.local_experts\.(\d+)\.")

    def resolve(meta, *, base_name=None):
        base = meta.name if base_name is None else base_name
        found = local.search(base)
        if not meta.is_ep or found is None:
            return original(meta, base_name=base_name)
        ranks = meta.expert_parallel_group_ranks
        meta.global_expert_index = ranks.index(meta.owner_rank) * (meta.num_experts // len(ranks)) + int(
            found.group(1)
        )
        meta.resolved_name = base[: found.start(1)] + str(meta.global_expert_index) + base[found.end(1) :]

    utils.assign_ep_resolved_name_inplace = resolve


# -- memory ------------------------------------------------------------------------------------------
class AllocationTracker(TorchDispatchMode):
    """Tensor storage allocated inside the block on this thread: the most alive at once (`peak`)
    and what is still alive at its end (`held()`). A storage counts from the op that made it (an
    output aliasing none of its inputs) until the last tensor on it, views included, dies.
    What a backend allocates on its own threads (gloo's staging buffers) is not seen."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, list[int]] = {}  # storage pointer -> [bytes, tensors alive on it]
        self.current = self.peak = 0

    def _drop(self, ptr: int) -> None:
        entry = self.live.get(ptr)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self.live[ptr]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr()
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor)
        }
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr in self.live:
                self.live[ptr][1] += 1
            elif ptr in inputs or storage.nbytes() == 0:
                continue
            else:
                self.live[ptr] = [storage.nbytes(), 1]
                self.current += storage.nbytes()
                self.peak = max(self.peak, self.current)
            weakref.finalize(t, self._drop, ptr)
        return out

    def held(self) -> int:
        return sum(nbytes for nbytes, _ in self.live.values())


def _status_kb(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def measure_memory(fn) -> dict[str, int]:
    """Run `fn` once under the tracker; also the rise of this process's RSS high-water mark
    (reset first where Linux allows it, else 0)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        rss_before = _status_kb("VmRSS")
    except OSError:
        rss_before = None
    with AllocationTracker() as tracker:
        kept = fn()
    rss = 0 if rss_before is None else max(0, _status_kb("VmHWM") - rss_before) * 1024
    out = {"peak": tracker.peak, "held": tracker.held(), "rss_rise": rss}
    del kept
    return out


# -- one world -----------------------------------------------------------------------------------------
def _slowest(seconds: float) -> float:
    import torch.distributed as dist

    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _cpu_seconds() -> float:
    """This process's CPU time, all threads (gloo's too), user + system."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _timed(fn) -> tuple[float, float]:
    """Wall seconds of `fn` on the slowest rank, and the CPU-seconds all ranks spent on it (on an
    oversubscribed CPU the wall time measures the scheduler too, the CPU-seconds the work)."""
    import torch.distributed as dist

    dist.barrier()
    start, start_cpu = time.perf_counter(), _cpu_seconds()
    fn()
    cpu = torch.tensor([_cpu_seconds() - start_cpu], dtype=torch.float64)
    wall = _slowest(time.perf_counter() - start)
    dist.all_reduce(cpu)
    return wall, float(cpu.item())


def _generation_groups(layout, rank: int, tp, pp, dp, self_group, *, tp_rank: int, pp_rank: int):
    """A `MegatronGroups` for a GPTModel of generation sizes `layout` on the given process groups."""
    import torch.distributed as dist
    from megatron.core.process_groups_config import ProcessGroupCollection

    from rl3d.models.bootstrap import MegatronGroups
    from rl3d.parallel.layout import RankCoords

    return MegatronGroups(
        layout=layout,
        rank=rank,
        coords=RankCoords(pp=pp_rank, dp=0, tp=tp_rank),
        tp_group=tp,
        pp_group=pp,
        dp_group=dp,
        mp_group=None,
        embedding_group=None,
        # a mixture of experts' generation copy holds every expert (ep 1, cp 1); its tp x dp group
        # is the whole world when there is one generation stage (the only case benchmarked)
        pg_collection=ProcessGroupCollection(
            tp=tp,
            pp=pp,
            dp=dp,
            cp=self_group,
            embd=None,
            ep=self_group,
            expt_tp=tp,
            expt_dp=dp,
            tp_cp=tp,
            tp_ep=tp,
            tp_dp_cp=dist.group.WORLD if layout.p == 1 else None,
        ),  # fmt: skip
        ep_group=self_group,
        expert_dp_group=dp,
        expert_tp_group=tp,
    )


def _new_groups(rank_lists: list[list[int]], rank: int):
    """Every rank creates every group (torch.distributed's rule); returns this rank's."""
    import torch.distributed as dist

    mine = None
    for ranks in rank_lists:
        handle = dist.new_group(ranks=ranks)
        if rank in ranks:
            mine = handle
    return mine


def _plan_traffic(plan, src, dst, rank: int) -> dict[str, int]:
    """Remote bytes and messages of this rank's megatron plan (a self-transfer is a local copy)."""
    src_params, dst_params = dict(src.named_parameters()), dict(dst.named_parameters())

    def nbytes(params, op) -> int:
        t = params[op.param_name].data[op.my_slice]
        return t.numel() * t.element_size()

    recvs = [op for op in plan.recv_ops if op.peer_rank != rank]
    sends = [op for op in plan.send_ops if op.peer_rank != rank]
    return {
        "recv": sum(nbytes(dst_params, op) for op in recvs),
        "send": sum(nbytes(src_params, op) for op in sends),
        "messages": len(recvs),
        "local_copies": len(plan.recv_ops) - len(recvs),
    }


class Sides:
    """One rank's three ways from the training model to the generation weights."""

    def __init__(self, rank: int, world: int, model: str, layout, t_g: int, p_g: int, bucket_mb: float):
        import torch.distributed as dist

        from rl3d.hybrid_engine.executor import Resharder
        from rl3d.hybrid_engine.weights import SeededFullModel
        from rl3d.models.bootstrap import init_megatron
        from rl3d.models.builder import build_gpt, rank_param_names
        from rl3d.models.params import local_param, model_params
        from rl3d.models.spec import get_model_spec
        from rl3d.ops.layouts import shard_for_tp
        from rl3d.parallel import GenerationLayout, ParallelLayout
        from rl3d.parallel.groups import build_hybrid_groups
        from rl3d.parallel.sharding import padded_vocab_size

        self.rank, self.t_g, self.p_g = rank, t_g, p_g
        self.spec = get_model_spec(model)
        train = ParallelLayout(*layout)
        self.gen = GenerationLayout.from_training(train, t_g, p_g)
        self.groups = init_megatron(train, seed=1)
        self.params = model_params(self.spec, train_tp=train.t)
        self.info = {p.name: p for p in self.params}
        self.full = SeededFullModel(self.params, seed=7, dtype=torch.float32)
        self.vocab = padded_vocab_size(self.spec.vocab_size, train.t)

        # the training model, its weights cut from the full model; rl3d moves these very tensors
        self.src = build_gpt(self.spec, self.groups, padded_vocab=self.vocab)
        local = dict(self.src.named_parameters())
        names = rank_param_names(self.spec, self.groups)
        self.train_shards = {g: local_param(local, n).data for g, n in names.items()}
        with torch.no_grad():
            for g, t in self.train_shards.items():
                t.copy_(shard_for_tp(self.full[g], self.info[g].kind, train.t, self.groups.tp_rank))

        self.hybrid = build_hybrid_groups(self.gen, timeout_s=1800)
        self.resharder = Resharder(
            self.spec,
            self.hybrid,
            bucket_mb=bucket_mb,
            dtype=torch.float32,
            params=self.params,
            time_phases=True,
        )
        self.plan_s = {"rl3d": _slowest(self.resharder.plan_seconds)}
        self.weights = None  # rl3d's generation weights, once made

        self.me = [dist.new_group(ranks=[r]) for r in range(world)][rank]  # megatron's cp group
        self.targets = {}  # megatron side -> {"model", "groups", "traffic"}
        for side, ggroups, src_pgs in self._megatron_layouts(world):
            self._plan_megatron(side, ggroups, src_pgs)
        from megatron.core.resharding.copy_services.gloo_copy_service import GlooCopyService

        self.services = {side: GlooCopyService() for side in self.targets}

    def _megatron_layouts(self, world: int):
        """(side, the target's groups, the source's groups for planning) of both megatron sides."""
        import copy

        from rl3d.parallel import ParallelLayout

        g = self.gen.coords(self.rank)
        sizes = ParallelLayout(self.p_g, self.t_g, world // (self.p_g * self.t_g))
        ours = _generation_groups(
            sizes, self.rank, self.hybrid.gen_tp.handle, self.hybrid.gen_pp.handle, self.hybrid.gen_dp.handle,
            self.me, tp_rank=g.tp_g, pp_rank=g.pp_g,
        )  # fmt: skip
        planning = copy.copy(self.groups.pg_collection)
        planning.dp = self.me  # each training rank its own DP group: the source is the rank's own replica
        yield "megatron_rl3d_groups", ours, planning
        tp, pp, dp = (
            _new_groups(lists, self.rank)
            for lists in (sizes.tp_groups(), sizes.pp_groups(), sizes.dp_groups())
        )
        c = sizes.coords(self.rank)  # megatron's default order for the generation sizes
        default = _generation_groups(sizes, self.rank, tp, pp, dp, self.me, tp_rank=c.tp, pp_rank=c.pp)
        yield "megatron_default", default, self.groups.pg_collection

    def _plan_megatron(self, side: str, ggroups, src_pgs) -> None:
        from megatron.core.resharding import build_centralized_reshard_plan

        from rl3d.models.builder import build_gpt

        dst = build_gpt(self.spec, ggroups, padded_vocab=self.vocab)
        with torch.no_grad():
            for t in dst.parameters():
                t.fill_(float("nan"))  # every element must be written
        saved, self.src.pg_collection = self.src.pg_collection, src_pgs
        start = time.perf_counter()
        plan = build_centralized_reshard_plan(self.src, dst, num_experts=self.spec.num_experts or None)
        self.plan_s[side] = _slowest(time.perf_counter() - start)
        self.src.pg_collection = saved
        dst._cached_reshard_plan = plan  # what reshard_model_weights caches: later calls only execute
        traffic = _plan_traffic(plan, self.src, dst, self.rank)
        self.targets[side] = {"model": dst, "groups": ggroups, "traffic": traffic}

    # -- the three ways -----------------------------------------------------------------------------
    def run(self, side: str):
        if side == "rl3d":
            self.weights = None  # the previous generation buffers go first, as after a rollout
            self.weights = self.resharder.to_generation(self.train_shards)
            return self.weights
        from megatron.core.resharding import swap_model_weights

        swap_model_weights(self.src, self.targets[side]["model"], self.services[side])

    def materialize(self) -> dict[str, torch.Tensor]:
        """One Megatron tensor per parameter from rl3d's pieces (what megatron's target holds)."""
        return {n: self.weights.materialize(n) for n in self.weights.names()}

    def time(self, repeats: int, warmup: int) -> dict:
        runs = {side: [] for side in SIDES}
        cpu = {side: [] for side in SIDES}
        phases, layout_s = [], []
        for k in range(warmup + repeats):
            for side in SIDES:  # alternating, so that the machine's moods fall on all three
                seconds, cpu_s = _timed(lambda side=side: self.run(side))
                if k >= warmup:
                    runs[side].append(seconds)
                    cpu[side].append(cpu_s)
                if k >= warmup and side == "rl3d":
                    stats = self.resharder.last_stats
                    phases.append({**stats.phases, "total": stats.seconds})
            seconds, _ = _timed(self.materialize)
            if k >= warmup:
                layout_s.append(seconds)
        return {"runs": runs, "cpu": cpu, "phases": phases, "layout_s": layout_s}

    def memory(self) -> dict:
        """One untimed run of each side under the tracker."""
        self.weights = None
        out = {"rl3d": measure_memory(lambda: self.run("rl3d"))}
        out["rl3d"]["kept"] = self.resharder.last_stats.alloc_bytes
        for side, target in self.targets.items():
            out[side] = measure_memory(lambda side=side: self.run(side))
            out[side]["kept"] = sum(t.numel() * t.element_size() for t in target["model"].parameters())
        return out

    def traffic(self) -> dict:
        stats = self.resharder.last_stats
        out = {"rl3d": {"recv": stats.recv_bytes, "send": stats.send_bytes, "messages": stats.messages}}
        out.update({side: target["traffic"] for side, target in self.targets.items()})
        return out

    def check(self) -> dict:
        """Wrong generation weights per side: rl3d's against the full model, megatron's with rl3d's
        groups against rl3d's, megatron's default against the full model at its own coordinates."""
        from rl3d.models.params import local_param, stage_param_names
        from rl3d.ops.layouts import shard_for_tp

        def slice_of(name: str, tp_rank: int) -> torch.Tensor:
            return shard_for_tp(self.full[name], self.info[name].kind, self.t_g, tp_rank)

        mine = self.materialize()
        g = self.gen.coords(self.rank)
        out = {
            "rl3d": {
                "checked": len(mine),
                "wrong": [n for n, t in mine.items() if not torch.equal(t, slice_of(n, g.tp_g))],
            }
        }
        for side, target in self.targets.items():
            coords = target["groups"].coords
            names = stage_param_names(self.spec, self.p_g, coords.pp)
            local = dict(target["model"].named_parameters())
            wrong = []
            for n, local_name in names.items():
                got = local_param(local, local_name).data
                expected = mine.get(n) if side == "megatron_rl3d_groups" else slice_of(n, coords.tp)
                if expected is None or got.shape != expected.shape or not torch.equal(got, expected):
                    wrong.append(n)
            if side == "megatron_rl3d_groups" and set(names) != set(mine):
                wrong.append(f"names differ: {sorted(set(names) ^ set(mine))}")
            out[side] = {"checked": len(names), "wrong": wrong}
        return out


def worker(rank, world, model, cases, repeats, warmup, bucket_mb):
    """Every (layout, t_g, p_g) of `cases` in turn (all of this world's size): one result each."""
    import torch.distributed as dist

    from rl3d.models.bootstrap import destroy_megatron

    shim_gloo_copy_service()
    shim_sequential_expert_names()
    results = []
    for layout, t_g, p_g in cases:
        sides = Sides(rank, world, model, layout, t_g, p_g, bucket_mb)
        result = {"rank": rank, **sides.time(repeats, warmup)}
        result["traffic"] = sides.traffic()  # of the last timed run (every run moves the same)
        result["calls"] = {"rl3d": sides.resharder.last_stats.calls, **{side: 1 for side in sides.targets}}
        result["memory"] = sides.memory()
        result["checks"] = sides.check()
        result["plan_s"] = sides.plan_s
        result["model_bytes"] = sum(p.numel for p in sides.params) * 4
        results.append(result)
        del sides
        dist.barrier()
        destroy_megatron()
    return results


# -- the run -------------------------------------------------------------------------------------------
def _gen_name(layout, t_g: int, p_g: int) -> str:
    from rl3d.parallel import GenerationLayout, ParallelLayout

    return str(GenerationLayout.from_training(ParallelLayout(*layout), t_g, p_g))


def summarize(model: str, layout, t_g: int, p_g: int, ranks: list[dict]) -> list[dict]:
    """One row per side from every rank's result."""
    first = ranks[0]
    rows = []
    rl3d_recv = [r["traffic"]["rl3d"]["recv"] for r in ranks]
    rl3d_send = [r["traffic"]["rl3d"]["send"] for r in ranks]
    rl3d_s = statistics.median(first["runs"]["rl3d"])
    rl3d_cpu = statistics.median(first["cpu"]["rl3d"])
    for side in SIDES:
        recv = [r["traffic"][side]["recv"] for r in ranks]
        send = [r["traffic"][side]["send"] for r in ranks]
        seconds = statistics.median(first["runs"][side])
        cpu_s = statistics.median(first["cpu"][side])
        kept = [r["memory"][side]["kept"] for r in ranks]
        # megatron's target model exists before the call: its peak is the target plus the call's own
        extra = [
            r["memory"][side]["peak"] + (r["memory"][side]["kept"] if side != "rl3d" else 0) for r in ranks
        ]
        row = {
            "model": model,
            "model_mb": round(first["model_bytes"] / MB, 1),
            "train": layout_name(layout),
            "gen": _gen_name(layout, t_g, p_g),
            "ranks": len(ranks),
            "side": side,
            "recv_mb_max": round(max(recv) / MB, 3),
            "send_mb_max": round(max(send) / MB, 3),
            "recv_bytes_per_rank": ";".join(map(str, recv)),
            "send_bytes_per_rank": ";".join(map(str, send)),
            "messages_max": max(r["traffic"][side]["messages"] for r in ranks),
            "local_copies_max": max(r["traffic"][side].get("local_copies", 0) for r in ranks),
            "calls": max(r["calls"][side] for r in ranks),
            "seconds": round(seconds, 5),
            "seconds_runs": ";".join(f"{s:.5f}" for s in first["runs"][side]),
            "rl3d_over_this": round(rl3d_s / seconds, 3) if seconds else None,
            "cpu_s": round(cpu_s, 5),
            "rl3d_over_this_cpu": round(rl3d_cpu / cpu_s, 3) if cpu_s else None,
            "plan_s": round(first["plan_s"][side], 4),
            "kept_mb_max": round(max(kept) / MB, 3),
            "peak_extra_mb_max": round(max(extra) / MB, 3),
            "rss_rise_mb_max": round(max(r["memory"][side]["rss_rise"] for r in ranks) / MB, 1),
            "checked": sum(r["checks"][side]["checked"] for r in ranks),
            "bit_equal": all(not r["checks"][side]["wrong"] for r in ranks),
            "bytes_equal_rl3d": (recv == rl3d_recv and send == rl3d_send)
            if side != "megatron_default"
            else None,
        }
        if side == "rl3d":
            row["layout_s"] = round(statistics.median(first["layout_s"]), 5)
            row.update(_phase_means(ranks))
        rows.append(row)
    return rows


def _phase_means(ranks: list[dict]) -> dict:
    """Per phase: the median over runs of the rank mean; `other` is the rest of to_generation
    (bookkeeping outside the timed phases), taken run by run."""
    runs = []
    for k in range(len(ranks[0]["phases"])):
        per_rank = [dict(r["phases"][k]) for r in ranks]
        for phases in per_rank:
            phases["other"] = phases["total"] - sum(phases.get(p, 0.0) for p in PHASES)
        runs.append(
            {
                name: statistics.fmean(p.get(name, 0.0) for p in per_rank)
                for name in (*PHASES, "other", "total")
            }
        )
    return {f"phase_{name}": round(statistics.median(run[name] for run in runs), 5) for name in runs[0]}


def write_markdown(result: dict, path: Path) -> None:
    rows = result["rows"]
    lines = [
        "# rl3d's transition vs megatron-core's resharding",
        "",
        f"`{result['command']}`",
        "",
        ("" if result["finished"] else "**Cut off: the layouts that finished so far.** ")
        + f"{result['date']}, {result['machine']}; load average before {result['load_before']}, "
        f"after {result['load_after']}. Seconds: slowest rank, median of {result['repeats']} runs after "
        f"{result['warmup']} warm-up; CPU s: user + system time of all ranks (gloo's threads too), median.",
        "",
        "| model | train -> gen | ranks | side | recv MB/rank (max) | sent MB/rank (max) "
        "| msgs recv/rank | seconds | rl3d / this | CPU s | rl3d / this (CPU) | plan s | kept MB "
        "| peak extra MB | RSS rise MB | bit-equal | bytes = rl3d |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        same = {True: "yes", False: "NO", None: "-"}[r["bytes_equal_rl3d"]]
        lines.append(
            f"| {r['model']} ({r['model_mb']} MB) | {r['train']} -> {r['gen']} | {r['ranks']} | {r['side']} "
            f"| {r['recv_mb_max']:.3f} | {r['send_mb_max']:.3f} | {r['messages_max']} | {r['seconds']:.4f} "
            f"| {r['rl3d_over_this']:.2f} | {r['cpu_s']:.4f} | {r['rl3d_over_this_cpu']:.2f} "
            f"| {r['plan_s']:.3f} | {r['kept_mb_max']:.2f} "
            f"| {r['peak_extra_mb_max']:.2f} | {r['rss_rise_mb_max']:.1f} "
            f"| {'yes' if r['bit_equal'] else 'NO'} | {same} |"
        )
    loads = dict.fromkeys(
        f"{r['model']} on {r['ranks']} ranks: {r['load_before']}" for r in rows if "load_before" in r
    )
    lines += ["", "Load average (1, 5, 15 min) as each world started: " + "; ".join(loads) + "."]
    lines += [
        "",
        "rl3d's phases (seconds, rank mean, median over runs): `Resharder(time_phases=True)`; "
        "`layout` materializes one Megatron tensor per parameter afterwards (not part of the transition).",
        "",
        "| model | train -> gen | plan | buffer | pack | collective | p2p | assemble | other | to_generation "
        "| layout |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["side"] != "rl3d":
            continue
        cells = " | ".join(f"{r[f'phase_{p}']:.4f}" for p in (*PHASES, "other", "total"))
        lines.append(
            f"| {r['model']} | {r['train']} -> {r['gen']} | {r['plan_s']:.3f} | {cells} "
            f"| {r['layout_s']:.4f} |"
        )
    path.write_text("\n".join(lines) + "\n")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(2, len(models), figsize=(6 * len(models), 8), squeeze=False)
    for col, model in enumerate(models):
        mine = [r for r in rows if r["model"] == model]
        labels = list(dict.fromkeys(f"{r['train']}\n-> {r['gen']}" for r in mine))
        ax = axes[0][col]
        width = 0.8 / len(SIDES)
        for i, side in enumerate(SIDES):
            ys = [r["seconds"] * 1e3 for r in mine if r["side"] == side]
            ax.bar([x + i * width for x in range(len(labels))], ys, width, label=side)
        ax.set_xticks([x + width for x in range(len(labels))], labels, fontsize=8)
        ax.set_ylabel("ms, slowest rank (median)")
        ax.set_title(f"{model} ({mine[0]['model_mb']} MB fp32)")
        ax.legend(fontsize=8)
        ax = axes[1][col]
        bottom = [0.0] * len(labels)
        for phase in (*PHASES, "other"):
            ys = [r[f"phase_{phase}"] * 1e3 for r in mine if r["side"] == "rl3d"]
            ax.bar(range(len(labels)), ys, 0.6, bottom=bottom, label=phase)
            bottom = [b + y for b, y in zip(bottom, ys)]
        ax.set_xticks(range(len(labels)), labels, fontsize=8)
        ax.set_ylabel("ms, rank mean")
        ax.set_title("rl3d to_generation by phase")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_results(out: Path, result: dict) -> None:
    result = {**result, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load_after": _load()}
    rows = result["rows"]
    (out / "result.json").write_text(json.dumps(result, indent=1) + "\n")
    with open(out / "transition_vs_megatron.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
        writer.writeheader()
        writer.writerows(rows)
    write_markdown(result, out / "transition_vs_megatron.md")
    plot(rows, out / "transition_vs_megatron.png")


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=MODELS, help="comma-separated model names")
    parser.add_argument("--layouts", default=LAYOUTS, help="comma-separated P-T-D:TG[:PG]")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--bucket-mb", type=float, default=256.0, help="rl3d's bucket (its default)")
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    parser.add_argument("--timeout-s", type=float, default=1800.0)
    args = parser.parse_args(argv)
    from rl3d.testing.spawn import run_distributed

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import megatron.core

    command = "python benchmarks/transition_vs_megatron.py " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    result = {
        "command": command.strip(),
        "machine": f"{os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"megatron-core {megatron.core.__version__}, python {platform.python_version()}",
        "load_before": _load(),
        "repeats": args.repeats,
        "warmup": args.warmup,
        "finished": False,
    }
    models = args.models.split(",")
    cases = [parse_layout(text) for text in args.layouts.split(",")]
    by_world: dict[int, list] = {}  # one spawned world per size, its layouts in turn
    for case in cases:
        by_world.setdefault(case[0][0] * case[0][1] * case[0][2], []).append(case)
    done: dict[tuple, list[dict]] = {}  # (model, case) -> its rows
    for model in models:
        for world, mine in by_world.items():
            start, load = time.perf_counter(), _load()
            ranks = run_distributed(
                worker,
                world,
                model,
                mine,
                args.repeats,
                args.warmup,
                args.bucket_mb,
                timeout_s=args.timeout_s,
            )
            for k, case in enumerate(mine):
                done[(model, case)] = summarize(model, *case, [r[k] for r in ranks])
                for row in done[(model, case)]:
                    row["load_before"] = load  # 1, 5 and 15 minute load averages as the world started
            print(f"{model} on {world} ranks: {time.perf_counter() - start:.0f} s", file=sys.stderr)
            # written after every world, so that a run cut off still reports what finished
            rows = [row for m in models for case in cases for row in done.get((m, case), [])]
            write_results(out, {**result, "rows": rows})
    result.update(finished=True, rows=rows)
    write_results(out, result)
    print((out / "transition_vs_megatron.md").read_text())
    failed = [
        f"{r['model']} {r['train']} -> {r['gen']} {r['side']}"
        for r in rows
        if not r["bit_equal"] or r["bytes_equal_rl3d"] is False
    ]
    if failed:
        print("FAILED (bytes or weights differ): " + "; ".join(failed), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
