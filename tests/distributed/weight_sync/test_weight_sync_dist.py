"""The weight sync for real, over gloo: training ranks (one world) send their shards to rollout
ranks through a `WeightBridge` built on a separate TCPStore, as two pools do. Each rollout rank
gets its generation-TP shard of every parameter bit for bit, and the bytes counted on both sides
equal the plan's (`rl3d.hybrid_engine.pool`, run by the hybrid engine's point-to-point executor)."""

import datetime

import pytest
import torch
import torch.distributed as dist

from rl3d.hybrid_engine.pool import plan_pool_transition
from rl3d.models.params import model_params, stages_of
from rl3d.models.spec import get_model_spec
from rl3d.ops.layouts import shard_for_tp
from rl3d.parallel.layout import ParallelLayout
from rl3d.testing.spawn import free_port, run_distributed
from rl3d.weight_sync import WeightBridge, receive_weights, send_weights

pytestmark = pytest.mark.distributed
SPEC = get_model_spec("tiny-llama")


def _sync(rank, world, layout, t_g, d_g, port):
    from rl3d.hybrid_engine.weights import full_model

    params = [p for p in model_params(SPEC, train_tp=layout.t) if not p.tied_copy]
    full = full_model(params, seed=7, dtype=torch.float32)
    plan = plan_pool_transition(SPEC, layout, gen_tp=t_g, gen_dp=d_g, dtype="float32", bucket_bytes=48 * 1024)
    store = dist.TCPStore(
        "127.0.0.1", port, world, is_master=rank == 0, timeout=datetime.timedelta(seconds=60)
    )
    n = layout.world_size
    bridge = WeightBridge(store, rank=rank, num_train=n, num_rollout=world - n, device="cpu", timeout_s=60)
    if rank < n:
        c = layout.coords(rank)
        shards = {
            p.name: shard_for_tp(full[p.name], p.kind, layout.t, c.tp).clone()
            for p in params
            if c.pp in stages_of(p, SPEC.num_layers, layout.p)
        }
        return ("train", send_weights(bridge, plan, shards, rank).send_bytes)
    me = rank - n
    got, stats = receive_weights(bridge, plan, me, dtype=torch.float32)
    a = me % t_g
    for p in params:
        assert torch.equal(got[p.name], shard_for_tp(full[p.name], p.kind, t_g, a)), p.name
    assert set(got) == {p.name for p in params}
    return ("rollout", stats.recv_bytes, plan.bytes_to(me), plan.total_bytes)


LAYOUTS = [
    (1, 2, 1, 1, 1),  # shards merged
    (2, 1, 1, 2, 1),  # two stages, the training shard cut
    pytest.param(2, 2, 1, 1, 2, marks=pytest.mark.slow),  # two engines
    pytest.param(1, 2, 2, 2, 1, marks=pytest.mark.slow),  # replica 0 sends, replica 1 not
]


@pytest.mark.parametrize("p,t,d,t_g,d_g", LAYOUTS)
def test_rollout_ranks_get_their_generation_shards_bit_for_bit(p, t, d, t_g, d_g):
    layout = ParallelLayout(p, t, d)
    world = layout.world_size + t_g * d_g
    # six ranks each importing megatron-core take over 120 s to start on a loaded 2-core machine
    out = run_distributed(_sync, world, layout, t_g, d_g, free_port(), timeout_s=60 * world)
    sent = sum(r[1] for r in out if r[0] == "train")
    received = [r for r in out if r[0] == "rollout"]
    assert all(r[1] == r[2] for r in received)  # counted == planned, per rollout rank
    assert sent == sum(r[1] for r in received) == received[0][3]
