"""`actor.log_prob_micro_batch_size`: the old log-probs and the reference's in fewer, larger
forward-only micro-batches equal those of the training micro-batches bit for bit (each row's
outputs are its own), at the demo's TP 2 on 2 gloo ranks, with a quarter of the forwards and of
the TP all-reduces."""

import dataclasses

import pytest
import torch

from rl3d.testing.spawn import run_distributed

pytestmark = pytest.mark.distributed

RECIPE = "recipes/quickstart_cpu_grpo.yaml"  # micro_batch_size 8
B, P, R = 32, 9, 6


def worker(rank, world):
    import torch.distributed as dist

    from rl3d.config import load_config
    from rl3d.models.bootstrap import destroy_megatron, init_megatron
    from rl3d.models.spec import spec_of
    from rl3d.parallel.layout import ParallelLayout
    from rl3d.single_controller.batch import DataBatch
    from rl3d.workers.context import RoleContext
    from rl3d.workers.roles import ActorRolloutWorker, ReferenceWorker

    cfg = load_config(RECIPE, []).config
    groups = init_megatron(ParallelLayout(1, world, 1), seed=cfg.trainer.seed)
    spec = spec_of(cfg.model)
    actor = ActorRolloutWorker(RoleContext(cfg, spec, groups, tokenizer=None))
    reference = ReferenceWorker(RoleContext(cfg, spec, groups, tokenizer=None, init_from=actor.role))
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(3, spec.vocab_size, (B, P + R), generator=gen)
    mask = torch.ones(B, P + R, dtype=torch.long)
    mask[::3, :4] = 0  # left-padded prompts
    batch = DataBatch({"input_ids": ids, "attention_mask": mask, "responses": ids[:, P:]})
    batch = batch.set("response_mask", torch.ones(B, R, dtype=torch.long))
    calls = []
    reduce = dist.all_reduce
    dist.all_reduce = lambda *a, **k: calls.append(1) or reduce(*a, **k)
    out, counts = {}, {}
    for cap in (None, B):
        section = dataclasses.replace(cfg.actor, log_prob_micro_batch_size=cap)
        actor.cfg = reference.cfg = dataclasses.replace(cfg, actor=section)
        calls.clear()
        out[cap] = actor.compute_log_prob(batch).union(reference.compute_ref_log_prob(batch)).tensors
        counts[cap] = len(calls)
    dist.all_reduce = reduce
    destroy_megatron()
    return out, counts


def test_larger_forward_micro_batches_give_the_same_log_probs():
    for got, counts in run_distributed(worker, 2, timeout_s=240):
        small, large = got[None], got[B]
        for key in ("old_logp", "old_logp_entropy", "ref_logp", "ref_logp_entropy"):
            assert small[key].shape == (B, R), key
            assert torch.equal(small[key], large[key]), key
        # per forward: 5 TP all-reduces in the model, 2 in the log-probs; 4 forwards -> 1 per role
        assert counts == {None: 2 * 4 * 7, B: 2 * 1 * 7}, counts
