"""rl3d's actor update against an independent GRPO update in plain PyTorch.

The reference is an HF `LlamaForCausalLM` with the same initial weights as rl3d's actor (the
recipe loads them through `model.hf_path`), and about a hundred lines below: response
log-probs, the PPO clipped surrogate, the k3 KL to a reference policy in the loss, token-mean
over each mini-batch, global-norm gradient clipping and Adam with decoupled weight decay (none
on 1-D parameters, as megatron's optimizer does), all with the recipe's settings. Both are fed
the same prompts, responses, advantages (GRPO group-normalised from random scores), reference
log-probs and old log-probs. rl3d runs `ActorRolloutWorker.update_actor` on its DP share of
each batch, as the MEGATRON_COMPUTE dispatch hands it out. Each update makes two optimizer
steps (16 samples, mini-batch 8). Measured: max |rl3d - reference| over all weights after 1 and
3 updates 5.6e-7 / 5.5e-7 (TP=2 and TP=2 x PP=2), 3.2e-7 / 3.2e-7 (PP=2), 1.5e-7 / 2.8e-7 (DP=2).

Why the inputs are shaped so (each was needed for a 1e-6 comparison to mean something):
- Old log-probs are the reference policy's own at the start of each update plus +-0.5 nats, so
  the ratio clip is active on both sides from the first step.
- Reference log-probs are the initial policy's plus +-0.2 nats. With the frozen initial policy
  itself the KL gradient at the first step is exactly zero in the reference but fp32 noise
  (~1e-7) in rl3d, whose logits differ from HF's in the last bits; where every later token of
  a response is clipped, that noise is an embedding row's whole gradient, and Adam's first step
  (g / (|g| + eps)) turns it into an update of order lr: 3 rows differed by up to 5e-4.
- `adam_eps` is 1e-5, not the recipe's 1e-8: with 1e-8, the 1-3 of 120k weights whose gradient
  lies at the fp32 noise floor (~1e-10) get noise-driven updates; measured at TP=2, up to
  5.5e-6 with eps 1e-8 and 2.3e-6 with 1e-6 (every other weight within 1e-6).

Mini-batches: under DP=d, rl3d's k-th optimizer step takes the k-th mini-batch slice of
every DP rank's contiguous share of the batch, so which samples share a step depends on d.
The reference takes the same samples per step (`minibatch_rows`).
"""

import json
import math
from pathlib import Path

import pytest
import torch

from rl3d.testing.spawn import run_distributed

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes/quickstart_cpu_grpo.yaml"
NUM_PROMPTS, N, P, R = 4, 4, 6, 5  # prompts, samples per prompt, prompt / response widths
UPDATES, MINI, MICRO = 3, 8, 2
KL_COEF, WEIGHT_DECAY, CLIP = 0.1, 0.01, 0.2
LR, ADAM_EPS = 1e-3, 1e-5
TOL = 1e-6


def recipe_overrides(hf_dir, layout_pdt=(1, 1, 1)):
    p, t, d = layout_pdt
    return [
        f"model.hf_path={hf_dir}",
        f"actor.parallel={{pp: {p}, tp: {t}, dp: {d}}}",
        f"launch.nproc_per_node={p * t * d}",
        "rollout.t_g=1",
        "rollout.p_g=1",
        f"rollout.n={N}",
        f"data.prompts_per_step={NUM_PROMPTS}",
        f"actor.mini_batch_size={MINI}",
        f"actor.micro_batch_size={MICRO}",
        "actor.ppo_epochs=1",
        "actor.optim.distributed_optimizer=false",
        f"actor.optim.lr={LR}",
        "actor.optim.clip_grad=1.0",
        "actor.optim.lr_schedule=constant",
        "actor.optim.lr_warmup_steps=0",
        f"actor.optim.weight_decay={WEIGHT_DECAY}",
        f"actor.optim.adam_eps={ADAM_EPS}",
        "algorithm.policy_loss=ppo",
        f"algorithm.clip_low={CLIP}",
        f"algorithm.clip_high={CLIP}",
        "algorithm.loss_agg_mode=token-mean",
        "algorithm.entropy_coef=0.0",
        f"algorithm.kl.coef={KL_COEF}",
        "algorithm.kl.estimator=k3",
        "algorithm.kl.apply_to=loss",
    ]


def make_batches(vocab):
    """Left-padded prompts, right-padded responses, GRPO advantages, a log-prob perturbation."""
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
        batches.append(
            {
                "input_ids": torch.cat([prompt.masked_fill(~prompt_mask, 0), resp], 1),
                "attention_mask": torch.cat([prompt_mask, resp_mask], 1).long(),
                "responses": resp,
                "response_mask": resp_mask.long(),
                "advantages": adv.reshape(B, 1) * resp_mask,
                "noise": (torch.rand(B, R, generator=gen) - 0.5) * resp_mask,  # +-0.5 nats
                "ref_noise": (torch.rand(B, R, generator=gen) - 0.5) * 0.4 * resp_mask,
            }
        )
    return batches


def minibatch_rows(batch_size, dp):
    """The rows of each optimizer step: the k-th MINI // dp slice of every DP rank's share."""
    share, local = batch_size // dp, MINI // dp
    return [
        [r * share + k * local + i for r in range(dp) for i in range(local)] for k in range(share // local)
    ]


# -- the reference: plain PyTorch -------------------------------------------------------------
def response_logp(model, b):
    mask = b["attention_mask"]
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=b["input_ids"], attention_mask=mask, position_ids=position_ids).logits
    T = b["input_ids"].shape[1]
    logits = logits[:, T - R - 1 : T - 1].float()
    return torch.log_softmax(logits, -1).gather(-1, b["responses"][..., None])[..., 0]


def grpo_loss(model, b):
    mask = b["response_mask"].bool()
    logp = response_logp(model, b)
    ratio = torch.exp(logp - b["old_logp"])
    adv = b["advantages"]
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - CLIP, 1 + CLIP))
    log_r = b["ref_logp"] - logp
    kl = torch.exp(log_r) - 1 - log_r  # k3
    per_token = torch.where(mask, pg + KL_COEF * kl, torch.zeros_like(pg))
    return per_token.sum() / mask.sum()


class AdamW:
    """Adam (Kingma & Ba) with decoupled weight decay (Loshchilov & Hutter) and global-norm
    clipping; no decay on 1-D parameters (norm weights)."""

    def __init__(self, named_params, optim):
        self.params = [(p, optim.weight_decay if p.ndim > 1 else 0.0) for _, p in named_params]
        self.o, self.t = optim, 0
        self.m = [torch.zeros_like(p) for p, _ in self.params]
        self.v = [torch.zeros_like(p) for p, _ in self.params]

    @torch.no_grad()
    def step(self):
        o = self.o
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p, _ in self.params]
        norm = math.sqrt(sum(float(g.double().square().sum()) for g in grads))
        coef = o.clip_grad / (norm + 1e-6)
        if o.clip_grad > 0 and coef < 1.0:
            grads = [g * coef for g in grads]
        self.t += 1
        bc1, bc2 = 1 - o.adam_beta1**self.t, 1 - o.adam_beta2**self.t
        for (p, wd), g, m, v in zip(self.params, grads, self.m, self.v):
            p.mul_(1 - o.lr * wd)
            m.mul_(o.adam_beta1).add_(g, alpha=1 - o.adam_beta1)
            v.mul_(o.adam_beta2).addcmul_(g, g, value=1 - o.adam_beta2)
            p.addcdiv_(m, (v.sqrt() / math.sqrt(bc2)).add_(o.adam_eps), value=-o.lr / bc1)
        return norm


def reference_run(hf_dir, batches, optim, dp):
    """The batches as fed (with old and reference log-probs) and the weights after each update."""
    from transformers import LlamaForCausalLM

    def load():
        return LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")

    model, frozen = load(), load().eval()
    model.train()
    adam = AdamW(model.named_parameters(), optim)
    fed, weights = [], []
    for raw in batches:
        b = {k: v for k, v in raw.items() if "noise" not in k}
        with torch.no_grad():
            b["old_logp"] = (response_logp(model, b) + raw["noise"]) * b["response_mask"]
            b["ref_logp"] = (response_logp(frozen, b) + raw["ref_noise"]) * b["response_mask"]
        b["rollout_logp"] = b["old_logp"].clone()  # the engine's log-probs: no mismatch to correct
        fed.append(b)
        for rows in minibatch_rows(len(b["input_ids"]), dp):
            model.zero_grad(set_to_none=True)
            grpo_loss(model, {k: v[rows] for k, v in b.items()}).backward()
            adam.step()
        weights.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return fed, weights


# -- rl3d: the actor worker's update on every rank --------------------------------------------
def rl3d_worker(rank, world, layout_pdt, hf_dir, fed, out_dir):
    from rl3d.config import load_config
    from rl3d.models.bootstrap import destroy_megatron, init_megatron
    from rl3d.models.hf_mapping import hf_config_from_spec
    from rl3d.models.spec import get_model_spec
    from rl3d.models.weights import save_weights
    from rl3d.parallel.layout import ParallelLayout
    from rl3d.single_controller.batch import DataBatch
    from rl3d.workers.context import RoleContext
    from rl3d.workers.roles import ActorRolloutWorker

    cfg = load_config(RECIPE, recipe_overrides(hf_dir, layout_pdt)).config
    layout = ParallelLayout(*layout_pdt)
    groups = init_megatron(layout, seed=cfg.trainer.seed)
    spec = get_model_spec(cfg.model.name)
    actor = ActorRolloutWorker(RoleContext(cfg, spec, groups, tokenizer=None))
    metrics = []
    for k, b in enumerate(fed):
        mine = DataBatch(dict(b)).split(layout.d)[groups.dp_rank]  # MEGATRON_COMPUTE's share
        metrics.append(actor.update_actor(mine))
        if k + 1 in (1, UPDATES):
            dst = f"{out_dir}/after{k + 1}"
            save_weights(actor.role.model, spec, groups, dst, hf_config=hf_config_from_spec(spec).to_dict())
    destroy_megatron()
    return metrics


def hf_state(hf_dir):
    from safetensors.torch import load_file

    return {k: v for f in sorted(Path(hf_dir).glob("*.safetensors")) for k, v in load_file(f).items()}


def hf_weights(mcore_dir, tmp):
    """rl3d's saved weights (any layout) as an HF state dict, through rl3d's converter."""
    from rl3d.models.convert import mcore_to_hf

    return hf_state(mcore_to_hf(mcore_dir, tmp))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from rl3d.config import load_config
    from rl3d.testing.tiny_hf import save_tiny_hf_model

    hf_dir = tmp_path_factory.mktemp("hf") / "tiny-llama"
    save_tiny_hf_model("tiny-llama", hf_dir, seed=3)
    optim = load_config(RECIPE, recipe_overrides(hf_dir)).config.actor.optim
    assert optim.weight_decay == WEIGHT_DECAY and optim.clip_grad > 0 and optim.lr_schedule == "constant"
    vocab = json.loads((hf_dir / "config.json").read_text())["vocab_size"]
    batches = make_batches(vocab)
    return hf_dir, {dp: reference_run(hf_dir, batches, optim, dp) for dp in (1, 2)}


@pytest.mark.parametrize(
    "layout_pdt", [(1, 2, 1), (2, 1, 1), (1, 1, 2), (2, 2, 1)], ids=["tp2", "pp2", "dp2", "tp2xpp2"]
)
def test_actor_update_equals_plain_pytorch_grpo(setup, layout_pdt, tmp_path):
    hf_dir, references = setup
    p, t, d = layout_pdt
    fed, ref_weights = references[d]
    metrics = run_distributed(
        rl3d_worker, p * t * d, layout_pdt, str(hf_dir), fed, str(tmp_path), timeout_s=300
    )
    clipfrac = [m["actor/pg_clipfrac"] for ms in metrics for m in ms if m]
    assert all(0.05 < c < 0.95 for c in clipfrac), clipfrac  # the ratio clip is active
    initial = hf_state(hf_dir)
    diffs = {}
    for k, after in ((1, 0), (UPDATES, UPDATES - 1)):
        ours = hf_weights(tmp_path / f"after{k}", tmp_path / f"hf{k}")
        ref = ref_weights[after]
        assert set(ours) == set(ref)
        diffs[k] = max((ours[n] - ref[n]).abs().max().item() for n in ref)
        moved = max((ref[n] - initial[n]).abs().max().item() for n in ref)
        assert moved > 100 * TOL  # the updates really move the weights
    assert diffs[1] <= TOL and diffs[UPDATES] <= TOL, diffs  # max |rl3d - reference| per update count
