"""Expert parallelism in training: GRPO updates of a tiny Qwen3-MoE (8 experts, top 2) at
DP=2 with the experts split over both ranks (EP=2) against the same DP=2 with every expert on
every rank (EP=1), fp32, through the actor worker's update (`ActorRolloutWorker.update_actor`).

Only where each expert runs changes: under EP=2 a rank's tokens reach the other rank's experts
by all-to-all, an expert's gradient is summed over both ranks' tokens in one matmul instead of
two halves added by the DP all-reduce, and its optimizer state lives on one rank. Weights after
3 updates (6 optimizer steps) agree within 1e-6; the saved EP=2 directory (one file per EP
rank) converts back to the HF layout.
"""

from pathlib import Path

import pytest
import torch

from rl3d.testing.spawn import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[3]
RECIPE = ROOT / "recipes/quickstart_cpu_grpo.yaml"
NUM_PROMPTS, N, P, R = 4, 4, 6, 5
UPDATES, MINI, MICRO = 3, 8, 2
TOL = 1e-6


def overrides(hf_dir, ep, aux=0.0):
    return [
        "model.name=null",
        f"model.hf_path={hf_dir}",
        "model.dtype=float32",
        f"actor.parallel={{pp: 1, tp: 1, dp: 2, ep: {ep}}}",
        "launch.nproc_per_node=2",
        "rollout.t_g=1",
        f"rollout.n={N}",
        f"data.prompts_per_step={NUM_PROMPTS}",
        f"actor.mini_batch_size={MINI}",
        f"actor.micro_batch_size={MICRO}",
        "actor.optim.lr=1e-3",
        "actor.optim.adam_eps=1e-5",
        f"actor.moe.aux_loss_coef={aux}",
        "algorithm.kl.coef=0.0",
    ]


def make_batches(hf_dir):
    """Left-padded prompts, right-padded responses, GRPO advantages; old (= rollout) log-probs
    are the initial HF model's plus +-0.5 nats, so the ratio clip is active."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(19)
    B = NUM_PROMPTS * N
    batches = []
    for _ in range(UPDATES):
        prompt_len = torch.randint(2, P + 1, (NUM_PROMPTS,), generator=gen).repeat_interleave(N)
        prompt_mask = torch.arange(P) >= P - prompt_len[:, None]
        prompt = torch.randint(16, vocab, (NUM_PROMPTS, P), generator=gen).repeat_interleave(N, 0)
        resp_len = torch.randint(1, R + 1, (B,), generator=gen)
        resp_mask = torch.arange(R) < resp_len[:, None]
        resp = torch.randint(16, vocab, (B, R), generator=gen).masked_fill(~resp_mask, 0)
        scores = torch.rand(NUM_PROMPTS, N, generator=gen)
        adv = (scores - scores.mean(1, keepdim=True)) / (scores.std(1, keepdim=True) + 1e-6)
        ids = torch.cat([prompt.masked_fill(~prompt_mask, 0), resp], 1)
        mask = torch.cat([prompt_mask, resp_mask], 1).long()
        with torch.no_grad():
            logits = model(
                input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)
            ).logits
        logp = torch.log_softmax(logits[:, P - 1 : P + R - 1], -1).gather(-1, resp[..., None])[..., 0]
        old = (logp + (torch.rand(B, R, generator=gen) - 0.5)) * resp_mask
        batches.append(
            {
                "input_ids": ids,
                "attention_mask": mask,
                "responses": resp,
                "response_mask": resp_mask.long(),
                "advantages": adv.reshape(B, 1) * resp_mask,
                "old_logp": old,
                "rollout_logp": old.clone(),
            }
        )
    return batches


def worker(rank, world, hf_dir, ep, aux, fed, out_dir):
    from rl3d.config import load_config
    from rl3d.config.pools import role_pools
    from rl3d.models.bootstrap import destroy_megatron, init_megatron
    from rl3d.models.spec import spec_of
    from rl3d.models.weights import save_weights
    from rl3d.single_controller.batch import DataBatch
    from rl3d.workers.context import RoleContext
    from rl3d.workers.roles import ActorRolloutWorker

    cfg = load_config(RECIPE, overrides(hf_dir, ep, aux)).config
    layout = role_pools(cfg)[0].layout
    assert layout.ep == ep
    groups = init_megatron(layout, seed=cfg.trainer.seed)
    spec = spec_of(cfg.model)
    actor = ActorRolloutWorker(RoleContext(cfg, spec, groups, tokenizer=None))
    local_experts = len(actor.role.unwrapped().decoder.layers[0].mlp.experts.local_experts)
    metrics = []
    for b in fed:
        mine = DataBatch(dict(b)).split(layout.d)[groups.dp_rank]
        metrics.append(actor.update_actor(mine))
    hf_config = {**spec_to_config(spec), "model_type": "qwen3_moe"}
    save_weights(actor.role.model, spec, groups, out_dir, hf_config=hf_config)
    from rl3d.models.dist_checkpoint import save_checkpoint

    ckpt = f"{out_dir}-ckpt"
    save_checkpoint(
        ckpt, ddp=actor.role.ddp, optimizer=None, scheduler=None, groups=groups, iteration=UPDATES
    )
    destroy_megatron()
    return local_experts, metrics


def spec_to_config(spec):
    from rl3d.models.hf_mapping import hf_config_from_spec

    return hf_config_from_spec(spec).to_dict()


def hf_weights(mcore_dir, tmp):
    from safetensors.torch import load_file

    from rl3d.models.convert import mcore_to_hf

    out = mcore_to_hf(mcore_dir, tmp)
    return {k: v for f in sorted(Path(out).glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from rl3d.testing.tiny_hf import save_tiny_hf_model

    hf_dir = tmp_path_factory.mktemp("hf") / "tiny-qwen3-moe"
    save_tiny_hf_model("tiny-qwen3-moe", hf_dir, seed=5)
    return hf_dir, make_batches(hf_dir)


def _run(setup, tmp_path, ep, aux=0.0):
    hf_dir, fed = setup
    out = tmp_path / f"ep{ep}-aux{aux}"
    results = run_distributed(worker, 2, str(hf_dir), ep, aux, fed, str(out), timeout_s=300)
    return results, hf_weights(out, tmp_path / f"hf-ep{ep}-aux{aux}")


def test_ep2_update_equals_ep1(setup, tmp_path):
    hf_dir, _ = setup
    one, weights_one = _run(setup, tmp_path, ep=1)
    two, weights_two = _run(setup, tmp_path, ep=2)
    assert [r[0] for r in one] == [8, 8] and [r[0] for r in two] == [4, 4]  # experts per rank
    from safetensors.torch import load_file

    initial = load_file(str(hf_dir / "model.safetensors"))
    assert set(weights_one) == set(weights_two) == set(initial)
    diff = max((weights_one[n] - weights_two[n]).abs().max().item() for n in initial)
    moved = min(
        (weights_one[n] - initial[n]).abs().max().item() for n in initial if ".experts." in n or ".gate." in n
    )
    assert moved > 100 * TOL  # every expert and router moved
    assert diff <= TOL, diff
    from rl3d.models.export import export_hf
    from rl3d.models.spec import get_model_spec

    exported = export_hf(tmp_path / "ep2-aux0.0-ckpt", get_model_spec("tiny-qwen3-moe"), tmp_path / "export")
    exported = load_file(str(exported / "model.safetensors"))  # the training checkpoint at EP 2
    assert sorted(exported) == sorted(weights_two)
    assert all(torch.equal(exported[n], weights_two[n]) for n in exported)
    print(f"max |EP2 - EP1| over all weights after {UPDATES} updates: {diff:.2e}")
    for (_, metrics_one), (_, metrics_two) in zip(one, two):
        for m1, m2 in zip(metrics_one, metrics_two):
            assert m1["moe/dropped_tokens"] == m2["moe/dropped_tokens"] == 0.0
            assert 1.0 < m1["moe/load_max_over_mean"] < 8.0
            assert abs(m1["moe/load_max_over_mean"] - m2["moe/load_max_over_mean"]) < 1e-9
            assert m1["moe/load_max_over_mean"] == max(
                m1[f"moe/layer_{i}/load_max_over_mean"] for i in (0, 1)
            )
