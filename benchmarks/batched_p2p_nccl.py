"""A reshard whose point-to-point phases hold transfers both ways, on NCCL: each phase must go
out as one batch (`rl3d.hybrid_engine.comm.batch_p2p`), or NCCL waits on the peer until the
timeout. tests/distributed/hybrid_engine/test_batched_p2p_dist.py checks the batches on gloo,
which moves both directions either way; this runs the same transition where it matters.

Experts trained at expert TP 1 apart from TP (tiny-qwen2-moe, ep 2), generated at t_g 2, so pairs
of ranks trade expert parts in the same phase. Every rank checks each generation weight against
the full model's slice bit for bit and records its batches (one per phase, both directions
in one); two ranks also exchange a tensor both ways in one call. Under torchrun, one rank per
GPU (2, 4 or 8; TP 2 on 2 GPUs, else 4):

    torchrun --standalone --nproc_per_node 2 benchmarks/batched_p2p_nccl.py --out DIR
    torchrun --standalone --nproc_per_node 2 benchmarks/batched_p2p_nccl.py --out DIR --device cpu  # gloo

Rank 0 writes DIR/batched_p2p.json; every rank exits 1 when a check fails. A hang ends at the
groups' timeout (--timeout-s) as a failure that names the ranks waited for.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from rl3d.hybrid_engine.comm import CountedComm
from rl3d.hybrid_engine.executor import Resharder
from rl3d.hybrid_engine.plan import plan_transition
from rl3d.hybrid_engine.weights import full_model
from rl3d.models.spec import get_model_spec
from rl3d.ops.layouts import shard_for_tp
from rl3d.parallel import GenerationLayout, ParallelLayout
from rl3d.parallel.groups import build_hybrid_groups
from rl3d.utils.device import init_process_group, synchronize

EP, ETP, T_G = 2, 1, 2


def record_batches() -> list:
    """Each later `batch_isend_irecv` call's operations, sorted ("send"/"recv", peer), in order."""
    real, batches = dist.batch_isend_irecv, []

    def recording(ops):
        batches.append(sorted(("send" if op.op is dist.isend else "recv", op.peer) for op in ops))
        return real(ops)

    dist.batch_isend_irecv = recording
    return batches


def reshard(rank: int, world: int, device: torch.device, timeout_s: float) -> dict:
    spec = replace(get_model_spec("tiny-qwen2-moe"), num_query_groups=4)
    t = 2 if world == 2 else 4
    train = ParallelLayout(1, t, world // t, ep=EP, etp=ETP)
    groups = build_hybrid_groups(GenerationLayout.from_training(train, T_G, 1), timeout_s=timeout_s)
    plan = plan_transition(spec, train, T_G, dtype="float32", strategies=("hybridflow",))
    ctx = plan._ctx
    full = {k: v.to(device) for k, v in full_model(ctx.params, seed=5, dtype=torch.float32).items()}
    shards = {}
    for i in ctx.train_params(rank):
        p = ctx.params[i]
        shards[p.name] = shard_for_tp(full[p.name], p.kind, *reversed(ctx.split_of(i, rank))).clone()
    engine = Resharder(spec, groups, dtype=torch.float32, device=device, params=ctx.params, bucket_mb=0.01)
    batches = record_batches()
    start = time.perf_counter()
    weights = engine.to_generation(shards)
    synchronize(device)
    seconds = time.perf_counter() - start
    wrong = [
        n
        for n in weights.names()
        if not torch.equal(
            weights.reference_materialize(n),
            shard_for_tp(full[n], weights.params[n].kind, T_G, weights.gen_tp_rank),
        )
    ]
    phases = plan.strategies["hybridflow"].phases
    planned = [
        sorted(
            [("send", x.dst) for x in phase if x.src == rank]
            + [("recv", x.src) for x in phase if x.dst == rank]
        )
        for phase in phases
    ]
    planned = [ops for ops in planned if ops]
    reverse = sorted({p for ops in batches for kind, p in ops if kind == "send" and ("recv", p) in ops})
    return {
        "layout": f"1-{t}-{world // t} ep {EP} etp {ETP} t_g {T_G}",
        "seconds": seconds,
        "batches": len(batches),
        "planned_batches": len(planned),
        "batches_as_planned": batches == planned,
        "both_ways_with": reverse,
        "wrong": wrong,
    }


def exchange(rank: int, world: int, device: torch.device, timeout_s: float) -> list:
    """Rank pairs (0, 1), (2, 3), ... send each other a tensor in one call; what each received."""
    peer = rank ^ 1
    got = torch.zeros(3, device=device)
    CountedComm(rank, timeout_s).exchange(
        {peer: torch.full((3,), float(rank + 1), device=device)}, {peer: got}
    )
    return got.tolist()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--timeout-s", type=float, default=30.0)
    args = parser.parse_args()
    init_process_group(args.device, timeout_s=args.timeout_s)
    rank, world = dist.get_rank(), dist.get_world_size()
    if world not in (2, 4, 8):
        raise SystemExit(f"batched_p2p_nccl: run it on 2, 4 or 8 ranks, not {world}")
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        if args.device == "cuda"
        else torch.device("cpu")
    )
    mine = {"rank": rank, "exchange": exchange(rank, world, device, args.timeout_s)}
    mine |= reshard(rank, world, device, args.timeout_s)
    mine["ok"] = (
        mine["exchange"] == [float((rank ^ 1) + 1)] * 3 and mine["batches_as_planned"] and not mine["wrong"]
    )
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    result = {"backend": dist.get_backend(), "world": world, "ranks": everyone,
              "some_rank_sends_both_ways": any(r["both_ways_with"] for r in everyone),
              "ok": all(r["ok"] for r in everyone)}  # fmt: skip
    result["ok"] = result["ok"] and result["some_rank_sends_both_ways"]
    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "batched_p2p.json").write_text(json.dumps(result, indent=1))
        print(json.dumps({k: v for k, v in result.items() if k != "ranks"}))
    dist.destroy_process_group()
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
