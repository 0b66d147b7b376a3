"""A LoRA actor in the workers (one rank, fp32, tiny-llama): the reference worker builds no model
and its log-probs (the actor with adapters off) equal a separately built reference's; the
transition's merged weights, loaded into a plain model, give the LoRA actor's logits; the memory
plan counts exactly the adapters the model holds and shows no reference."""

import dataclasses

import pytest
import torch

from rl3d.config import load_config
from rl3d.engine import MegatronEngine
from rl3d.models.lora_names import peft_key
from rl3d.models.spec import spec_of
from rl3d.single_controller.batch import DataBatch
from rl3d.workers.context import RoleContext
from rl3d.workers.roles import ReferenceWorker

RECIPE = "recipes/quickstart_cpu_grpo.yaml"
ONE_RANK = ["actor.parallel.tp=1", "rollout.t_g=1", "launch.nproc_per_node=1"]
LORA = ["actor.lora.rank=4", "actor.lora.alpha=8", "actor.lora.target_modules=[all-linear]"]


@pytest.fixture(scope="module", params=["all-linear", "all-linear,lm_head"])
def actor(groups_1x1, request):
    cfg = load_config(RECIPE, [*ONE_RANK, *LORA, f"actor.lora.target_modules=[{request.param}]"]).config
    spec = spec_of(cfg.model)
    role = MegatronEngine.from_config(
        spec, groups_1x1, role="actor", model=cfg.model, seed=3, batching=cfg.actor, optim=cfg.actor.optim,
        lora=cfg.actor.lora,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # B is zero at the start: random adapters, so that they matter
        for p in role.lora.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return cfg, spec, role


def _batch(spec, prompt=5, response=4, rows=3):
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, spec.vocab_size, (rows, prompt + response), generator=gen)
    return DataBatch({
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "responses": ids[:, prompt:],
        "response_mask": torch.ones(rows, response, dtype=torch.long),
    })  # fmt: skip


def test_the_reference_is_the_actor_s_base_with_no_second_model(groups_1x1, actor):
    cfg, spec, role = actor
    lora_ref = ReferenceWorker(RoleContext(cfg, spec, groups_1x1, tokenizer=None, init_from=role))
    assert lora_ref.role is role  # no model built
    plain = dataclasses.replace(cfg, actor=dataclasses.replace(cfg.actor, lora=None))
    built = ReferenceWorker(RoleContext(plain, spec, groups_1x1, tokenizer=None, init_from=role))
    assert built.role is not role
    batch = _batch(spec)
    ours, theirs = lora_ref.compute_ref_log_prob(batch), built.compute_ref_log_prob(batch)
    assert (ours["ref_logp"] - theirs["ref_logp"]).abs().max() < 1e-6
    adapted = role.run_forward(batch, 3, lambda o, m: (torch.zeros(()), {"logits": o.detach()}))[0]["logits"]
    with role.adapters_disabled():
        base = role.run_forward(batch, 3, lambda o, m: (torch.zeros(()), {"logits": o.detach()}))[0]["logits"]
    assert (adapted - base).abs().max() > 1e-2  # the adapters are on outside the context


def test_the_transition_s_merged_weights_give_the_adapted_logits(groups_1x1, actor):
    cfg, spec, role = actor
    plain = MegatronEngine.from_config(spec, groups_1x1, role="actor", model=cfg.model, seed=3)
    moved, base = role.transition_shards(), role.global_shards()
    assert moved.keys() == base.keys()
    merged = {g for g in moved if not torch.equal(moved[g], base[g])}
    adapted = ("linear_qkv.weight", "linear_proj.weight", "fc1.weight", "fc2.weight")
    assert merged == {g for g in base if g.endswith(adapted)} | (
        {"output_layer.weight"} if cfg.actor.lora.lm_head else set()
    )
    with torch.no_grad():
        for g, t in plain.global_shards().items():
            t.copy_(moved[g])
    ids = _batch(spec)["input_ids"]
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    role.unwrapped().eval()
    with torch.no_grad():
        diff = (role.unwrapped()(ids, pos, None) - plain.unwrapped()(ids, pos, None)).abs().max()
    assert diff < 1e-5, diff


def test_the_memory_plan_counts_the_adapters_the_model_holds_and_no_reference(actor):
    from rl3d.planning import plan_memory
    from rl3d.planning.memory_adapters import adapter_numels, lm_head_numels

    cfg, spec, role = actor
    held = sum(p.numel() for p in role.lora.parameters())
    head = lm_head_numels(spec, 4, tp=1) if cfg.actor.lora.lm_head else []
    assert sum(adapter_numels(spec, cfg.actor.lora.targets, 4, tp=1, pp=1) + head) == held
    assert peft_key(0, "q_proj", "A") in role.lora_state_dict()
    plan = plan_memory(cfg).ranks[0].phases["train"]
    full = plan_memory(load_config(RECIPE, ONE_RANK).config).ranks[0].phases["train"]
    assert "reference" not in plan and "reference" in full
    a = plan["actor"]
    assert (a.grads, a.master, a.optimizer) == (4 * held, 0, 2 * 4 * held)
    assert a.params == full["actor"].params + 4 * held  # fp32 base here: its own bytes, plus the adapters


def test_fp32_adapters_over_a_bf16_base_train_and_checkpoint(groups_1x1, tmp_path):
    from megatron.core.optimizer.optimizer import FP32Optimizer

    from rl3d.models.dist_checkpoint import save_checkpoint

    cfg = load_config(RECIPE, [*ONE_RANK, *LORA, "model.dtype=bfloat16"]).config
    spec = spec_of(cfg.model)
    role = MegatronEngine.from_config(
        spec, groups_1x1, role="actor", model=cfg.model, seed=3, batching=cfg.actor, optim=cfg.actor.optim,
        lora=cfg.actor.lora,
    )  # fmt: skip
    assert {p.dtype for p in role.lora.parameters()} == {torch.float32}
    assert {p.dtype for p in role.unwrapped().parameters() if not p.requires_grad} >= {torch.bfloat16}
    # every trained parameter is fp32: megatron's fp32 optimizer, no master copy
    assert isinstance(role.optimizer.chained_optimizers[0], FP32Optimizer)
    batch = _batch(spec)

    def loss_of(output, micro):
        logits = role.response_slice(output, micro).float()
        return -(logits.log_softmax(-1).gather(-1, micro["responses"][..., None]).mean()), {}

    before = {n: p.detach().clone() for n, p in role.unwrapped().named_parameters() if not p.requires_grad}
    lora_before = role.lora_state_dict()
    role.train_minibatches(batch, mini_batch_size=3, micro_batch_size=3, epochs=1, loss_of=loss_of,
                           count_unit=lambda m: 1.0)  # fmt: skip
    assert all(torch.equal(p, before[n]) for n, p in role.unwrapped().named_parameters() if n in before)
    after = role.lora_state_dict()
    assert any(not torch.equal(after[k], lora_before[k]) for k in after if "lora_B" in k)
    save_checkpoint(tmp_path / "ckpt", ddp=role.ddp, optimizer=role.optimizer, scheduler=role.scheduler,
                    groups=groups_1x1, iteration=1)  # fmt: skip
