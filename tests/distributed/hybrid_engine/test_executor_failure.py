"""A rank that dies mid-transition ends the others with a clear error within the timeout."""

import os
import time

import pytest
import torch
import torch.multiprocessing as mp

TIMEOUT_S = 15.0


def _rank_main(rank, world, port, queue, mode):
    import datetime

    import torch.distributed as dist

    from rl3d.hybrid_engine.comm import CountedComm
    from rl3d.hybrid_engine.executor import Resharder
    from rl3d.hybrid_engine.params import model_params
    from rl3d.hybrid_engine.weights import full_model, training_shards
    from rl3d.models.spec import get_model_spec
    from rl3d.parallel import GenerationLayout, ParallelLayout
    from rl3d.parallel.groups import build_hybrid_groups

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=TIMEOUT_S),
    )
    spec = get_model_spec("tiny-llama")
    train = ParallelLayout(1, 4, 1)
    groups = build_hybrid_groups(GenerationLayout.from_training(train, 1, 1), timeout_s=TIMEOUT_S)
    params = model_params(spec, train_tp=4)
    shards = training_shards(
        full_model(params, seed=0, dtype=torch.float32),
        params,
        pp_rank=0,
        pp=1,
        tp_rank=rank,
        tp=4,
        num_layers=spec.num_layers,
    )
    if rank == 3:  # die after the first bucket went out: mid-transition
        real = CountedComm.all_gather_v

        def die_after_first(self, group, chunks):
            real(self, group, chunks)
            if mode == "hang":  # alive but silent: the others must time out, not wait forever
                time.sleep(TIMEOUT_S * 4)
            os._exit(17)

        CountedComm.all_gather_v = die_after_first
    start = time.monotonic()
    try:
        Resharder(spec, groups, bucket_mb=0.01, dtype=torch.float32).to_generation(shards)
        queue.put((rank, "finished", time.monotonic() - start))
    except Exception as err:  # the survivors must end up here
        queue.put((rank, f"{type(err).__name__}: {err}", time.monotonic() - start))


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["exit", pytest.param("hang", marks=pytest.mark.slow)])
def test_dead_rank_fails_the_others_within_timeout(mode):
    from rl3d.testing.spawn import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, 4, port, queue, mode)) for r in range(4)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 120
    reports = {}
    while len(reports) < 3 and time.monotonic() < deadline:
        if not queue.empty():
            rank, message, seconds = queue.get()
            reports[rank] = (message, seconds)
        time.sleep(0.05)
    for p in procs:
        p.join(timeout=10 if mode == "exit" else 0.1)
        if p.is_alive():
            p.kill()
            p.join()
    if mode == "exit":
        assert procs[3].exitcode == 17
    assert sorted(reports) == [0, 1, 2], reports
    for rank, (message, seconds) in reports.items():
        assert message.startswith("ReshardError"), (rank, message)
        assert "micro_dp group [0, 1, 2, 3]" in message and "3" in message.split("waited for ranks")[1]
        assert seconds < TIMEOUT_S + 10, (rank, seconds)
