"""A point-to-point phase goes out as one batch, on gloo as on NCCL. NCCL progresses a rank's
concurrent sends and receives only inside one group: a transfer whose reverse is in the same
phase (the expert parts at etp != tp, t_g > 1) issued on its own would wait for the peer until the
timeout. gloo moves both directions at once, so these tests record the batches instead of hoping
for a hang: `torch.distributed.batch_isend_irecv` is wrapped to note each call's operations and
then run them, and each rank's batches must be its phases' transfers, one batch per phase.
"""

from dataclasses import replace

import pytest
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
from rl3d.testing.spawn import run_distributed
from rl3d.utils.net import free_port

pytestmark = pytest.mark.distributed

# experts at etp 1 apart from tp 4, generated at t_g 2: ranks 0 and 1 (2 and 3) trade parts
LAYOUT, EP, ETP, T_G = (1, 4, 1), 2, 1, 2


def record_batches() -> list:
    """Each later `batch_isend_irecv` call's operations made by a point-to-point phase
    (`CountedComm.exchange`; on gloo the all-gathers are batches too), sorted ("send"/"recv",
    peer), in order."""
    real, batches, inside = dist.batch_isend_irecv, [], []
    real_exchange = CountedComm.exchange

    def recording(ops):
        if inside:
            batches.append(sorted(("send" if op.op is dist.isend else "recv", op.peer) for op in ops))
        return real(ops)

    def exchange(self, *args, **kwargs):
        inside.append(True)
        try:
            return real_exchange(self, *args, **kwargs)
        finally:
            inside.pop()

    # a spawned rank's own modules: nothing to restore
    dist.batch_isend_irecv = recording
    CountedComm.exchange = exchange
    return batches


def model():
    return replace(get_model_spec("tiny-qwen2-moe"), num_query_groups=4)


def reshard_worker(rank, world):
    train = ParallelLayout(*LAYOUT, ep=EP, etp=ETP)
    groups = build_hybrid_groups(GenerationLayout.from_training(train, T_G, 1), timeout_s=60)
    ctx = plan_transition(model(), train, T_G, dtype="float32", strategies=("hybridflow",))._ctx
    full = full_model(ctx.params, seed=5, dtype=torch.float32)
    shards = {}
    for i in ctx.train_params(rank):
        p = ctx.params[i]
        shards[p.name] = shard_for_tp(full[p.name], p.kind, *reversed(ctx.split_of(i, rank))).clone()
    engine = Resharder(model(), groups, dtype=torch.float32, params=ctx.params, bucket_mb=0.01)
    batches = record_batches()
    weights = engine.to_generation(shards)
    wrong = [
        n
        for n in weights.names()
        if not torch.equal(
            weights.reference_materialize(n),
            shard_for_tp(full[n], weights.params[n].kind, T_G, weights.gen_tp_rank),
        )
    ]
    return {"batches": batches, "wrong": wrong}


def test_a_phase_with_reverse_transfers_is_one_batch_per_rank():
    train = ParallelLayout(*LAYOUT, ep=EP, etp=ETP)
    results = run_distributed(reshard_worker, train.world_size, timeout_s=300)
    phases = plan_transition(model(), train, T_G, dtype="float32", strategies=("hybridflow",))
    phases = phases.strategies["hybridflow"].phases
    reverse = []  # (rank, peer): a batch that sends to peer and receives from it
    for rank, got in enumerate(results):
        assert got["wrong"] == [], rank
        planned = [
            sorted(
                [("send", t.dst) for t in phase if t.src == rank]
                + [("recv", t.src) for t in phase if t.dst == rank]
            )
            for phase in phases
        ]
        assert got["batches"] == [ops for ops in planned if ops], rank  # one batch per phase, whole
        reverse += [
            (rank, p) for ops in got["batches"] for kind, p in ops if kind == "send" and ("recv", p) in ops
        ]
    assert reverse  # the case that hangs when the two directions go out apart


def exchange_worker(rank, world, port):
    """Ranks 0 and 1 send each other a tensor in one exchange, over the world and over a bridge
    (a gloo group outside the world, as `rl3d.weight_sync.WeightBridge` makes)."""
    peer = 1 - rank
    out = {}
    batches = record_batches()
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0)
    bridge = dist.ProcessGroupGloo(dist.PrefixStore("bridge/", store), rank, world, dist.default_pg_timeout)
    for name, over in (("world", None), ("bridge", bridge)):
        comm = CountedComm(rank, 30.0, bridge=over)
        got = torch.zeros(3)
        comm.exchange({peer: torch.full((3,), float(rank + 1))}, {peer: got}, tag=7)
        c = comm.counter
        out[name] = (got.tolist(), c.calls, c.send_bytes, c.recv_bytes, dict(c.recv_from))
    out["batches"] = batches
    return out


def test_exchange_both_ways_is_one_call_over_the_world_and_a_bridge():
    results = run_distributed(exchange_worker, 2, free_port(), timeout_s=120)
    for rank, got in enumerate(results):
        peer = 1 - rank
        for name in ("world", "bridge"):
            assert got[name] == ([float(peer + 1)] * 3, 1, 12, 12, {peer: 12}), (rank, name)
        # the world's exchange is one batch_isend_irecv holding both directions (the bridge's
        # goes to its backend directly: a P2POp cannot name a group outside the world)
        assert got["batches"] == [[("recv", peer), ("send", peer)]], rank


def gather_worker(rank, world):
    """`all_gather_v` both ways on gloo (point to point, and the collectives NCCL takes), equal
    and unequal chunk sizes: the same chunks arrive; the point-to-point way is one batch."""
    from rl3d.hybrid_engine import comm as comm_module
    from rl3d.parallel.groups import Group

    group = Group("all", tuple(range(world)), dist.group.WORLD)
    out = {}
    for sizes in ((5, 5, 5), (0, 7, 3)):
        for by_p2p in (True, False):
            comm_module.gather_by_p2p = lambda _group, by_p2p=by_p2p: by_p2p
            chunks = {m: torch.full((n,), -1.0) for m, n in enumerate(sizes)}
            chunks[rank] = torch.arange(sizes[rank], dtype=torch.float32) + 100 * rank
            comm = CountedComm(rank, 60)
            works = comm.all_gather_v(group, chunks, async_op=True)
            comm.wait(works, group)
            out[(sizes, by_p2p)] = ({m: t.tolist() for m, t in chunks.items()}, comm.counter.calls)
    return out


def test_all_gather_v_is_the_same_by_point_to_point_and_by_collectives():
    results = run_distributed(gather_worker, 3, timeout_s=120)
    for rank, out in enumerate(results):
        for sizes in ((5, 5, 5), (0, 7, 3)):
            want = {m: [float(i + 100 * m) for i in range(n)] for m, n in enumerate(sizes)}
            p2p, calls_p2p = out[(sizes, True)]
            coll, _ = out[(sizes, False)]
            assert p2p == coll == want, (rank, sizes)
            assert calls_p2p == 1, (rank, sizes)  # one batch, whatever the sizes
