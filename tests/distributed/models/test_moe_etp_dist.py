"""Expert tensor parallelism apart from dense TP: GRPO updates of a tiny Qwen3-MoE (8 experts,
top 2) at TP 2 x ETP 1 x EP 2 on 4 ranks (DP 2, sequence parallelism on by `auto`) against
TP 1 x DP 2 x EP 1, fp32, through the actor worker, with routing replay of random expert sets.

At ETP 1 megatron decomposes each stage's 4 ranks a second time for the experts: the two TP
ranks of one replica are the two EP ranks (each holding 4 whole experts), and the replicas'
ranks with the same EP rank average those experts' gradients. Weights after 3 updates (6 Adam
steps) agree within 1e-6 (`TOL`, as the TP x EP test), old log-probs within 1e-5; replicas of
every shard (dense over DP, experts over expert DP) stay equal bit for bit.
"""

import json

import pytest
import test_moe_tp_ep_dist as tp_ep_cases  # its batch maker and recipe overrides (same directory)
import torch

from rl3d.testing.spawn import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

TOL, LOGP_TOL = 1e-6, 1e-5


def worker(rank, world, hf_dir, tp, ep, etp, fed, out_dir):
    from rl3d.config import load_config
    from rl3d.config.pools import role_pools
    from rl3d.models.bootstrap import destroy_megatron, init_megatron
    from rl3d.models.builder import rank_param_names
    from rl3d.models.dist_checkpoint import save_checkpoint
    from rl3d.models.hf_mapping import hf_config_from_spec
    from rl3d.models.params import local_param, megatron_params
    from rl3d.models.spec import spec_of
    from rl3d.models.training import unwrap_model
    from rl3d.models.weights import save_weights
    from rl3d.single_controller.batch import DataBatch
    from rl3d.workers.context import RoleContext
    from rl3d.workers.roles import ActorRolloutWorker

    extra = [] if etp is None else [f"actor.parallel.etp={etp}"]
    cfg = load_config(tp_ep_cases.RECIPE, tp_ep_cases.overrides(hf_dir, tp, ep, world, False) + extra).config
    layout = role_pools(cfg)[0].layout
    groups = init_megatron(layout, seed=cfg.trainer.seed)
    spec = spec_of(cfg.model)
    actor = ActorRolloutWorker(RoleContext(cfg, spec, groups, tokenizer=None))
    shares = [DataBatch(dict(b)).split(layout.d)[groups.dp_rank] for b in fed]
    params = dict(unwrap_model(actor.role.model).named_parameters())
    infos = {p.name: p for p in megatron_params(spec)}

    def shards():  # global name -> (split rank, split size, kind, tensor)
        out = {}
        for name, local in rank_param_names(spec, groups).items():
            expert = infos[name].expert is not None
            split = (groups.etp_rank, layout.expert_t) if expert else (groups.tp_rank, layout.t)
            out[name] = (*split, infos[name].kind, local_param(params, local).detach().clone())
        return out

    initial = shards()
    old = actor.compute_log_prob(shares[0])
    for mine in shares:
        actor.update_actor(mine)
    trained = shards()
    hf_config = {**hf_config_from_spec(spec).to_dict(), "model_type": "qwen3_moe"}
    save_weights(actor.role.model, spec, groups, out_dir, hf_config=hf_config)
    role = actor.role
    ckpt = f"{out_dir}-ckpt"  # a training checkpoint (megatron's dist checkpoint) too
    save_checkpoint(
        ckpt, ddp=role.ddp, optimizer=role.optimizer, scheduler=role.scheduler, groups=groups, iteration=3
    )
    destroy_megatron()
    logp = old["old_logp"] if groups.tp_rank == 0 else None
    return groups.dp_rank, logp, trained, initial


def merged(results):
    """Full tensors from every rank's shards; every replica of a shard must be equal."""
    from rl3d.ops.layouts import merge_tp_shards

    by_name: dict[str, dict[int, torch.Tensor]] = {}
    kinds = {}
    for shards in results:
        for name, (index, size, kind, tensor) in shards.items():
            kinds[name] = (kind, size)
            seen = by_name.setdefault(name, {})
            if index in seen:
                assert torch.equal(seen[index], tensor), f"replicas of {name} shard {index} differ"
            seen[index] = tensor
    out = {}
    for name, parts in by_name.items():
        kind, size = kinds[name]
        assert sorted(parts) == list(range(size)), (name, sorted(parts))
        out[name] = merge_tp_shards([parts[i] for i in range(size)], kind)
    return out


def test_tp2_etp1_ep2_update_equals_tp1_ep1(tmp_path_factory):
    from rl3d.testing.tiny_hf import save_tiny_hf_model

    hf_dir = tmp_path_factory.mktemp("hf") / "tiny-qwen3-moe"
    save_tiny_hf_model("tiny-qwen3-moe", hf_dir, seed=5)
    fed = tp_ep_cases.make_batches(hf_dir)
    out = tmp_path_factory.mktemp("saved")
    one = run_distributed(worker, 2, str(hf_dir), 1, 1, None, fed, str(out / "one"), timeout_s=600)
    two = run_distributed(worker, 4, str(hf_dir), 2, 2, 1, fed, str(out / "two"), timeout_s=600)
    # ETP 1: every expert shard is whole on its rank; each rank holds 4 of the 8 experts
    assert {size for r in two for n, (_, size, _, _) in r[2].items() if ".experts." in n} == {1}
    assert all(sum(".experts." in n for n in r[2]) == 4 * 2 * 2 for r in two)  # x 2 layers x fc1, fc2
    w_one, w_two = merged(r[2] for r in one), merged(r[2] for r in two)
    start_one, start_two = merged(r[3] for r in one), merged(r[3] for r in two)
    assert set(w_one) == set(w_two) == set(start_one)
    assert all(torch.equal(start_one[n], start_two[n]) for n in start_one)  # the same HF weights loaded
    moved = min(
        (w_one[n] - start_one[n]).abs().max().item() for n in w_one if ".experts." in n or "router" in n
    )
    assert moved > 100 * TOL  # every expert and router moved
    diff = max((w_one[n] - w_two[n]).abs().max().item() for n in w_one)

    def logps(results):  # DP ranks 0, 1 (their TP rank 0's), concatenated
        return torch.cat([r[1] for r in sorted(results, key=lambda r: r[0]) if r[1] is not None])

    logp_diff = (logps(one) - logps(two)).abs().max().item()
    assert logp_diff <= LOGP_TOL, logp_diff
    assert diff <= TOL, diff
    # the saved ETP 1 directory (dense files by TP, expert files by EP rank) converts back to HF
    assert sorted(p.name for p in (out / "two").glob("expert_rank_*")) == [
        "expert_rank_00_000_000",
        "expert_rank_00_000_001",
    ]
    hf_one, hf_two = (tp_ep_cases.hf_weights(out / k, out / f"hf-{k}") for k in ("one", "two"))
    assert set(hf_one) == set(hf_two)
    assert max((hf_one[n] - hf_two[n]).abs().max().item() for n in hf_one) == diff
    # `rl3d export` of the ETP 1 training checkpoint: the same weights, bit for bit
    from safetensors.torch import load_file

    from rl3d.models.export import export_hf
    from rl3d.models.hf_mapping import spec_from_hf_config

    spec = spec_from_hf_config(json.loads((hf_dir / "config.json").read_text()))
    exported = export_hf(f"{out / 'two'}-ckpt", spec, out / "exported")
    from_ckpt = load_file(str(exported / "model.safetensors"))
    assert set(from_ckpt) == set(hf_two) and all(torch.equal(from_ckpt[n], hf_two[n]) for n in hf_two)
    print(f"max |TP2xETP1xEP2 - TP1xEP1| weights after 3 updates {diff:.2e}, old logp {logp_diff:.2e}")
