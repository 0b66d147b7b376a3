"""Delta weight syncs for real, over gloo (`rl3d.weight_sync.delta`): a training rank takes 20
Adam steps on fp32 master weights of the tiny model (a real backward each step) and syncs the
cast weights to a rollout rank after each; the rollout rank holds the trainer's bits exactly
after every sync, and the bytes both sides count agree. A lost update (the rollout rank does not
apply one) and a restarted engine (it holds nothing) are detected by the version check and
repaired by a full send of the affected buckets."""

import datetime

import pytest
import torch
import torch.distributed as dist

from rl3d.hybrid_engine.pool import plan_pool_transition
from rl3d.models.params import model_params
from rl3d.models.spec import get_model_spec
from rl3d.parallel.layout import ParallelLayout
from rl3d.testing.spawn import free_port, run_distributed
from rl3d.weight_sync import DeltaReceiver, DeltaSender, WeightBridge, receive_weights, send_weights

pytestmark = pytest.mark.distributed
SPEC = get_model_spec("tiny-llama")
STEPS = 20


def _training(dtype):
    """The trainer's weights after each Adam step (deterministic: both ranks compute it, the
    rollout rank to check what it holds)."""
    from rl3d.hybrid_engine.weights import full_model

    params = [p for p in model_params(SPEC, train_tp=1) if not p.tied_copy]
    master = {k: v.requires_grad_() for k, v in full_model(params, seed=7, dtype=torch.float32).items()}
    targets = full_model(params, seed=8, dtype=torch.float32)
    opt = torch.optim.Adam(master.values(), lr=5e-4)
    yield {k: v.detach().to(dtype) for k, v in master.items()}  # version 0: before training
    for _ in range(STEPS - 1):
        opt.zero_grad()
        loss = sum(((master[k] - targets[k]) ** 2).mean() for k in master)
        loss.backward()
        opt.step()
        yield {k: v.detach().to(dtype) for k, v in master.items()}


def _bits(t):
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def _sync(rank, world, dtype_name, lose_at, restart_at, port):
    dtype = getattr(torch, dtype_name)
    layout = ParallelLayout(1, 1, 1)
    plan = plan_pool_transition(
        SPEC, layout, gen_tp=1, gen_dp=1, dtype=dtype_name, bucket_bytes=48 * 1024, delta=True
    )
    store = dist.TCPStore(
        "127.0.0.1", port, world, is_master=rank == 0, timeout=datetime.timedelta(seconds=60)
    )
    bridge = WeightBridge(store, rank=rank, num_train=1, num_rollout=1, device="cpu", timeout_s=60)
    out = []
    if rank == 0:
        sender = DeltaSender()
        for weights in _training(dtype):
            stats = send_weights(bridge, plan, weights, 0, delta=sender)
            assert stats.send_bytes + stats.recv_bytes == stats.delta.wire_bytes
            out.append((stats.delta, sender.held_bytes))
        return out
    receiver = DeltaReceiver()
    for step, want in enumerate(_training(dtype)):
        if step == restart_at:
            receiver = DeltaReceiver()  # a restarted engine holds no version
        if step == lose_at:  # received, never applied: the engine stays on the version before
            lost = DeltaReceiver()
            lost.held = dict(receiver.held)
            receive_weights(bridge, plan, 0, dtype=dtype, delta=lost)
            out.append(None)
            continue
        got, stats = receive_weights(bridge, plan, 0, dtype=dtype, delta=receiver)
        assert set(got) == set(want)
        for name, tensor in want.items():
            assert torch.equal(_bits(got[name]), _bits(tensor)), (step, name)  # bit for bit
        assert stats.send_bytes + stats.recv_bytes == stats.delta.wire_bytes
        assert stats.delta.full_bytes == plan.bytes_to(0)
        out.append(stats.delta)
    return out


def _run(dtype_name, lose_at=-1, restart_at=-1):
    sent, received = run_distributed(_sync, 2, dtype_name, lose_at, restart_at, free_port(), timeout_s=300)
    return sent, received


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float32"])
def test_twenty_adam_steps_arrive_bit_for_bit(dtype_name):
    sent, received = _run(dtype_name)
    assert len(received) == STEPS
    for (s, held), r in zip(sent, received):
        assert s.wire_bytes == r.wire_bytes and s.changed == r.changed and s.kinds == r.kinds
        assert held == s.full_bytes  # the sender keeps one copy of what it sends
    first, rest = received[0], received[1:]
    assert first.kinds == {"full": sum(first.kinds.values())}  # nothing held yet
    if dtype_name == "bfloat16":  # most elements keep their bf16 value in a step of lr 5e-4
        assert all(r.wire_bytes < 0.75 * r.full_bytes for r in rest), [
            r.wire_bytes / r.full_bytes for r in rest
        ]
        assert all("full" not in r.kinds for r in rest)
    else:  # in fp32 nearly every element moves: full buckets, a few bytes of header more
        assert all(r.changed > 0.9 * r.numel for r in rest)
        assert all(r.wire_bytes <= r.full_bytes + 40 * sum(r.kinds.values()) for r in rest)


def test_a_lost_update_and_a_restarted_engine_are_repaired_by_a_full_send():
    sent, received = _run("bfloat16", lose_at=8, restart_at=14)
    messages = sum(sent[0][0].kinds.values())
    kinds = [s.kinds for s, _ in sent]
    assert received[8] is None  # checked bit for bit on every other step, the repaired ones too
    for step in (0, 9, 14):  # the first, after the lost update, after the restart
        assert kinds[step] == {"full": messages}, (step, kinds[step])
    for step in set(range(1, STEPS)) - {9, 14}:
        assert "full" not in kinds[step], (step, kinds[step])
