"""The identity transition (t_g = t, p_g = p) on the real megatron actor: the torch engine reads
the training parameters in place, over two GRPO steps.

Per step: the reshard moves 0 bytes and allocates nothing (`reshard/bytes`, `reshard/peak_bytes`
0); each engine weight is the very parameter tensor megatron trains (same storage and offset,
also inside the distributed optimizer's contiguous parameter buffer); generating from those
in-place weights equals generating from a copy of them bit for bit (tokens and log-probs); and
after the optimizer step the views the engine held see the updated values (megatron updates the
parameters in place, never swapping their storage), so the next step generates from the new
policy, not a stale one. With the distributed optimizer the parameters are views into
megatron's contiguous parameter buffer, which its optimizer updates through its own views.
"""

import pytest
import torch

from rl3d.testing.spawn import run_distributed

pytestmark = pytest.mark.distributed

RECIPE = "recipes/quickstart_cpu_grpo.yaml"
STEPS, PROMPTS, N, NEW_TOKENS = 2, 4, 2, 6


def overrides(hf_dir, tp, dtype, distributed_optimizer):
    return [
        f"model.hf_path={hf_dir}",
        f"model.dtype={dtype}",
        f"actor.parallel={{pp: 1, tp: {tp}, dp: 1}}",
        f"launch.nproc_per_node={tp}",
        f"rollout.t_g={tp}",
        f"rollout.n={N}",
        f"rollout.max_new_tokens={NEW_TOKENS}",
        f"actor.optim.distributed_optimizer={str(distributed_optimizer).lower()}",
        "actor.optim.lr=1e-2",
        f"actor.mini_batch_size={PROMPTS * N}",
        f"actor.micro_batch_size={PROMPTS * N}",
        "algorithm.kl.coef=0.0",
    ]


def identity_worker(rank, world, hf_dir, dtype, distributed_optimizer):
    from rl3d.config import load_config
    from rl3d.models.bootstrap import destroy_megatron, init_megatron
    from rl3d.models.spec import spec_of
    from rl3d.parallel.layout import ParallelLayout
    from rl3d.rollout import SamplingParams, build_rollout_engine
    from rl3d.single_controller.batch import DataBatch
    from rl3d.workers.context import RoleContext
    from rl3d.workers.roles import ActorRolloutWorker

    cfg = load_config(RECIPE, overrides(hf_dir, world, dtype, distributed_optimizer)).config
    groups = init_megatron(ParallelLayout(1, world, 1), seed=cfg.trainer.seed)
    spec = spec_of(cfg.model)
    actor = ActorRolloutWorker(RoleContext(cfg, spec, groups, tokenizer=None))
    tp_group = actor.rollout.hybrid_groups.gen_tp if world > 1 else None
    copy_engine = build_rollout_engine(cfg.rollout, spec=spec, group=tp_group)
    gen = torch.Generator().manual_seed(5)
    prompt_ids = [torch.randint(3, spec.vocab_size, (4 + i,), generator=gen).tolist() for i in range(PROMPTS)]
    prompts = DataBatch(meta={"prompt_ids": prompt_ids, "uid": list(range(PROMPTS))})
    out, held, before = [], {}, {}
    for step in range(STEPS):
        metrics = actor.reshard()
        params = actor.role.global_shards()
        pieces = actor.rollout.engine.weights.pieces
        in_place = all(
            len(pieces[n]) == 1 and pieces[n][0].data_ptr() == t.data_ptr() and pieces[n][0].shape == t.shape
            for n, t in params.items()
            if n in pieces
        )
        # the views the engine held during the previous step now read the updated parameters
        fresh_views = all(torch.equal(v, params[n]) for n, v in held.items())
        changed = step == 0 or any(not torch.equal(t, params[n]) for n, t in before.items())
        copy_engine.load_weights({n: ps[0].clone() for n, ps in pieces.items()})
        sampling = SamplingParams(n=N, max_new_tokens=NEW_TOKENS, seed=11 + step)
        a = actor.rollout.engine.generate(prompt_ids, sampling)
        b = copy_engine.generate(prompt_ids, sampling)
        same = torch.equal(a.response_ids, b.response_ids) and torch.equal(a.logprobs, b.logprobs)
        batch = actor.generate_sequences(prompts, step=step)
        signs = torch.tensor([1.0, -1.0]).repeat(len(batch) // 2)[:, None]
        batch = batch.set("advantages", signs * batch["response_mask"])
        held = {n: ps[0] for n, ps in pieces.items()}
        before = {n: t.clone() for n, t in held.items()}
        actor.release_generation()
        actor.update_actor(batch)
        out.append(
            {
                "bytes": metrics["reshard/bytes"],
                "peak": metrics["reshard/peak_bytes"],
                "gen_bytes": metrics["reshard/gen_bytes"],
                "seconds": metrics["reshard/seconds"],
                "in_place": in_place,
                "same": same,
                "fresh_views": fresh_views,
                "changed": changed,
                "tokens": a.lengths.sum().item(),
                "storages": len({t.untyped_storage().data_ptr() for t in params.values()}),
                "num_params": len(params),
            }
        )
    destroy_megatron()
    return out


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from rl3d.testing.tiny_hf import save_tiny_hf_model

    path = tmp_path_factory.mktemp("hf") / "tiny-llama"
    save_tiny_hf_model("tiny-llama", path, seed=3)
    return path


def check(results, *, buffer: bool):
    for rank, steps in enumerate(results):
        for step, got in enumerate(steps):
            where = f"rank {rank} step {step}: {got}"
            # the distributed optimizer's parameters live in megatron's contiguous buffer
            assert (got["storages"] < got["num_params"]) == buffer, where
            assert got["bytes"] == 0 and got["peak"] == 0 and got["gen_bytes"] > 0, where
            assert got["seconds"] < 0.05, where  # nothing moves: only bookkeeping
            assert got["in_place"] and got["same"] and got["fresh_views"] and got["changed"], where
            assert got["tokens"] == PROMPTS * N * NEW_TOKENS, where


def test_identity_engine_reads_training_params_in_place_distributed_optimizer(hf_dir):
    check(run_distributed(identity_worker, 1, str(hf_dir), "float32", True, timeout_s=240), buffer=True)


@pytest.mark.slow
def test_identity_engine_reads_training_params_in_place_tp2_fp32(hf_dir):
    check(run_distributed(identity_worker, 2, str(hf_dir), "float32", False, timeout_s=240), buffer=False)
