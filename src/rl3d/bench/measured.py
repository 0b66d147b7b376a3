"""Measured transition times: every strategy on real process groups, side by side, one launch.

gloo on CPU (or NCCL on GPUs). For each strategy: warm-up runs, then `repeats` timed runs (the
slowest rank's time, barrier before each; median reported), the counted bytes against the
planner's, an optional verification pass, and the same bytes moved by one flat collective per
group (`Resharder.raw_transfer`): the fabric's own limit, so the ratio shows the executor's
overhead. Raw all-gathers of several sizes also fit the alpha-beta model's constants here.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from rl3d.hybrid_engine.plan import plan_transition
from rl3d.hybrid_engine.strategy import STRATEGIES, get_strategy
from rl3d.utils.device import collective_device, init_process_group, resolve_device
from rl3d.utils.dtypes import torch_dtype


def _slowest(seconds: float, device: torch.device) -> float:
    t = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _cpu_seconds() -> float:
    """This process's CPU time, all threads (gloo's socket threads too), user + system."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _timed(fn, device: torch.device, cpu: list | None = None) -> float:
    """Wall seconds of `fn` on the slowest rank; appends the CPU-seconds all ranks spent on it
    to `cpu` when given (on an oversubscribed CPU the wall time measures the scheduler, the
    CPU-seconds the work)."""
    dist.barrier()
    start, start_cpu = time.perf_counter(), _cpu_seconds()
    fn()
    wall = _slowest(time.perf_counter() - start, device)
    if cpu is not None:
        spent = torch.tensor([_cpu_seconds() - start_cpu], dtype=torch.float64, device=device)
        dist.all_reduce(spent)
        cpu.append(float(spent.item()))
    return wall


def _fit_samples(device, dtype, world: int) -> list[tuple[int, int, float]]:
    """Raw all-gathers over the world at several sizes: (ring steps, bytes received, seconds)."""
    samples = []
    group = dist.group.WORLD
    for numel in (1 << 10, 1 << 14, 1 << 17, 1 << 19):
        outs = [torch.empty(numel, dtype=dtype, device=device) for _ in range(world)]
        mine = torch.ones(numel, dtype=dtype, device=device)
        gather = lambda outs=outs, mine=mine: dist.all_gather(outs, mine, group=group)  # noqa: E731
        times = [_timed(gather, device) for _ in range(4)]
        recv = (world - 1) * numel * mine.element_size()
        samples.append((world - 1, recv, statistics.median(times[1:])))
    return samples


def _links(engine, plan, strategy: str, nodes) -> dict:
    """Bytes counted on each link (every rank's bytes per sender, gathered) next to the planned.
    Empty when a rank that moved bytes (a rollout rank) is on none of `nodes`."""
    from rl3d.hybrid_engine.nodes import link_bytes

    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, engine.last_stats.recv_from)
    counted = {(src, dst): b for dst, got in enumerate(everyone) for src, b in (got or {}).items()}
    if not nodes.covers({r for pair in counted for r in pair}):
        return {}
    got, planned = link_bytes(counted, nodes), plan.link_bytes(strategy, nodes)
    return {"links": got.to_json(), "planned_links": planned.to_json(), "links_match": got == planned}


def _tx_bytes(iface: str) -> int:
    """Bytes `iface` has sent, in this process's network namespace (/proc/self/net/dev is per
    namespace; /sys/class/net is the one sysfs was mounted in)."""
    for line in Path("/proc/self/net/dev").read_text().splitlines()[2:]:
        name, _, fields = line.partition(":")
        if name.strip() == iface:
            return int(fields.split()[8])
    raise ValueError(f"no network interface {iface!r} in /proc/self/net/dev")


def _wire_sent(nodes, device) -> list[int] | None:
    """Bytes each node's network interface has sent so far (`RL3D_BENCH_LINK_IFACE`, read by
    each node's first rank: simulated nodes each have their own), or None when not set."""
    iface = os.environ.get("RL3D_BENCH_LINK_IFACE")
    if not iface or nodes is None:
        return None
    me = dist.get_rank()
    mine = 0
    if any(n[0] == me for n in nodes.nodes):
        mine = _tx_bytes(iface)
    sent = torch.zeros(nodes.num_nodes, dtype=torch.int64, device=device)
    for k, members in enumerate(nodes.nodes):
        if members[0] == me:
            sent[k] = mine
    dist.all_reduce(sent)
    return [int(v) for v in sent.tolist()]


def _training_nodes(nodes, train_world: int):
    """The training ranks of each node (nodes holding only rollout ranks dropped): what the
    planner and the executor route by."""
    from rl3d.hybrid_engine.nodes import NodeMap

    kept = [[r for r in members if r < train_world] for members in nodes.nodes]
    return NodeMap.of([m for m in kept if m])


def measured_worker(
    rank,
    world,
    model,
    layout,
    t_g,
    p_g,
    strategies,
    repeats,
    warmup,
    verify,
    bucket_mb,
    dtype_name,
    nodes=None,
    overlap_step_s=None,
):
    """Runs on every rank (spawned, or under torchrun); returns rank 0's results.

    `nodes` (lists of ranks) groups the ranks into nodes: every training rank, and the rollout
    ranks too where they are placed (then openrlhf's links are counted as well); hierarchical
    strategies route by the training ranks' grouping, and every strategy reports the bytes
    counted on each link next to the planned. `overlap_step_s` adds the measured overlap of
    hybridflow with a simulated optimizer step of that many seconds (`rl3d.bench.overlap`)."""
    from rl3d.hybrid_engine.executor import Resharder
    from rl3d.hybrid_engine.nodes import NodeMap
    from rl3d.hybrid_engine.params import model_params, stages_of
    from rl3d.hybrid_engine.weights import SeededFullModel, training_shards, zero_shards
    from rl3d.models.spec import get_model_spec
    from rl3d.parallel import GenerationLayout, ParallelLayout
    from rl3d.parallel.groups import build_hybrid_groups

    dtype = torch_dtype(dtype_name)
    device = collective_device()  # the world's backend: NCCL ranks are bound to their GPU
    spec = get_model_spec(model)
    train = ParallelLayout(*layout)
    n = train.world_size
    rollout = n if any(get_strategy(s).uses_rollout_ranks for s in strategies) else 0
    groups = build_hybrid_groups(
        GenerationLayout.from_training(train, t_g, p_g), timeout_s=600, rollout_ranks=rollout
    )
    params = model_params(spec, train_tp=train.t)
    full = SeededFullModel(params, seed=0, dtype=dtype)  # one full tensor at a time
    shards = {}
    if rank < n:
        c = train.coords(rank)
        shards = training_shards(
            full, params, pp_rank=c.pp, pp=train.p, tp_rank=c.tp, tp=train.t, num_layers=spec.num_layers
        )
    shards = {k: v.to(device) for k, v in shards.items()}
    unpiped = [p for p in params if stages_of(p, spec.num_layers, 1)]
    zero = (
        {k: v.to(device) for k, v in zero_shards(full, unpiped, rank=rank, world=n).items()}
        if rank < n
        else {}
    )
    node_map = NodeMap.of(nodes) if nodes is not None else None
    train_map = _training_nodes(node_map, n) if node_map is not None else None
    plan = plan_transition(
        spec, train, t_g, p_g, dtype=dtype_name, strategies=tuple(strategies), nodes=train_map
    )
    results = {}
    for strategy in strategies:
        engine = Resharder(
            spec, groups, strategy=strategy, bucket_mb=bucket_mb, dtype=dtype, device=device, nodes=train_map
        )
        kwargs = {"zero_shards": zero} if get_strategy(strategy).needs_zero_shards else {}

        def once(engine=engine, kwargs=kwargs):
            weights = engine.to_generation(shards, **kwargs)
            if weights is not None:
                weights.release()

        cpu: list[float] = []
        wire_before = _wire_sent(node_map, device)
        times = [_timed(once, device, cpu) for _ in range(warmup + repeats)][warmup:]
        wire_after = _wire_sent(node_map, device)
        recv = torch.tensor([engine.last_stats.recv_bytes], dtype=torch.int64, device=device)
        dist.all_reduce(recv, op=dist.ReduceOp.MAX)
        links = _links(engine, plan, strategy, node_map) if node_map is not None else {}
        calls = torch.tensor([engine.last_stats.calls], dtype=torch.int64, device=device)
        dist.all_reduce(calls, op=dist.ReduceOp.MAX)
        raw_cpu: list[float] = []
        raw = [_timed(engine.raw_transfer, device, raw_cpu) for _ in range(warmup + repeats)][warmup:]
        verified = False
        if verify:
            checker = Resharder(
                spec,
                groups,
                strategy=strategy,
                bucket_mb=bucket_mb,
                verify=True,
                dtype=dtype,
                device=device,
                nodes=train_map,
            )
            checker.to_generation(shards, **kwargs)  # raises ReshardError on any mismatch
            verified = True
        results[strategy] = {
            "seconds": statistics.median(times),
            "bytes_max": int(recv.item()),
            "planned_bytes_max": plan.strategies[strategy].comm_bytes_max,
            "verified": verified,
            "raw_seconds": statistics.median(raw),
            "cpu_seconds": statistics.median(cpu[warmup:]),
            "raw_cpu_seconds": statistics.median(raw_cpu[warmup:]),
            "all_seconds": times,
            "calls_max": int(calls.item()),
            **links,
        }
        if wire_before is not None:  # per transition, barriers and timing reductions included
            runs = warmup + repeats
            results[strategy]["wire_sent"] = [(b - a) // runs for a, b in zip(wire_before, wire_after)]
    fit = _fit_samples(device, dtype, dist.get_world_size())
    out = {"strategies": results, "fit_samples": fit, "device": str(device), "world": dist.get_world_size()}
    if node_map is not None:
        out["nodes"] = node_map.to_json()
    if overlap_step_s is not None:
        from rl3d.bench.overlap import measure_overlap

        engine = Resharder(
            spec, groups, strategy="hybridflow", bucket_mb=bucket_mb, dtype=dtype, device=device
        )
        out["overlap"] = measure_overlap(
            engine, shards, overlap_step_s, repeats=repeats, warmup=warmup, device=device
        )
    return out


def run_measured(
    model,
    layout,
    t_g,
    p_g,
    *,
    strategies=None,
    world=None,
    repeats=5,
    warmup=2,
    verify=False,
    bucket_mb=64.0,
    dtype="float32",
    gpus_per_node=None,
    nodes=None,
    overlap_step_s=None,
) -> dict:
    """Under torchrun: run in this process group. Otherwise spawn the ranks on this machine.

    Nodes: `nodes` (lists of training ranks, any grouping) or `gpus_per_node` (ranks 0..k-1 on
    node 0, ...); the JSON then has "nodes" and, per strategy, "links" (bytes counted on each
    link: "intra", "inter_in", "inter_out" per node, "inter_total", "node_bytes_max"),
    "planned_links" and "links_match". On one machine the nodes are simulated: every link is
    the same loopback, so only the bytes, not the times, tell the links apart."""
    strategies = tuple(STRATEGIES) if strategies is None else tuple(strategies)
    n = layout[0] * layout[1] * layout[2]
    separate = [s for s in strategies if get_strategy(s).uses_rollout_ranks]
    rollout = bool(separate)
    needed = 2 * n if rollout else n
    if world is not None and world != needed:
        raise ValueError(
            f"--world {world} does not fit: training {layout} needs {n} ranks"
            + (f" plus {n} rollout ranks for {', '.join(separate)}" if rollout else "")
        )
    if nodes is None and gpus_per_node is not None:
        from rl3d.hybrid_engine.nodes import NodeMap

        nodes = NodeMap.contiguous(n, gpus_per_node).to_json()
    args = (
        layout,
        t_g,
        p_g,
        tuple(strategies),
        repeats,
        warmup,
        verify,
        bucket_mb,
        dtype,
        nodes,
        overlap_step_s,
    )
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if not dist.is_initialized():
            init_process_group(resolve_device("auto"), timeout_s=1800)
        if dist.get_world_size() != needed:
            raise ValueError(f"torchrun world size {dist.get_world_size()} != {needed} needed")
        return measured_worker(dist.get_rank(), needed, model, *args)
    from rl3d.testing.spawn import run_distributed

    return run_distributed(measured_worker, needed, model, *args, timeout_s=1800)[0]
