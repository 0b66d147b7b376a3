"""The reward-model worker scores the same responses alike in every layout: a model saved at
tp=1 (a random tiny Llama with a scaled-up value head, so scores are O(1)) is loaded by
`RewardModelWorker` at tp=1, tp=2 and pp=2 on gloo ranks, and its scores of one batch (prompts
and responses of mixed lengths, an empty response among them) agree within 1e-5. Its HF export
(`rl3d export`: LlamaForSequenceClassification) scores them alike too."""

from pathlib import Path

import pytest
import torch

from rl3d.testing.spawn import run_distributed

ROOT = Path(__file__).resolve().parents[3]
PPO_RM = ROOT / "recipes/quickstart_cpu_ppo_rm.yaml"


def _batch():
    from rl3d.workers.reward_model import sequence_batch

    gen = torch.Generator().manual_seed(0)
    lengths = [(8, 8), (3, 5), (5, 0), (8, 1), (2, 7), (6, 3)]  # (prompt, response)
    prompts = [torch.randint(16, 32, (p,), generator=gen).tolist() for p, _ in lengths]
    responses = [torch.randint(0, 256, (r,), generator=gen).tolist() for _, r in lengths]
    batch = sequence_batch(prompts, responses, pad_token_id=0)
    batch.set("score", torch.tensor([0.5, 0.25, 0.0, 1.0, 0.75, 0.5]))
    return batch


def _save_random_model(rank, world_size, dst):
    from rl3d.engine import MegatronEngine
    from rl3d.models.bootstrap import init_megatron
    from rl3d.models.spec import get_model_spec
    from rl3d.parallel import ParallelLayout
    from rl3d.workers.reward_model import save_reward_model

    groups = init_megatron(ParallelLayout(1, 1, 1), seed=3)
    spec = get_model_spec("tiny-llama")
    role = MegatronEngine(spec, groups, role="critic", params_dtype=torch.float32, seed=11)
    with torch.no_grad():
        role.unwrapped().output_layer.weight.mul_(50.0)
    save_reward_model(role, Path(dst), meta={"objective": "reward"})
    packed = ["reward.model.packing=true", "reward.model.max_tokens_per_micro_batch=16"]
    return _score_in(groups, dst), _score_in(groups, dst, packed)


def _score(rank, world_size, weights, pp, tp):
    from rl3d.models.bootstrap import init_megatron
    from rl3d.parallel import ParallelLayout

    return _score_in(init_megatron(ParallelLayout(pp, tp, 1), seed=3), weights)


def _score_in(groups, weights, overrides=()):
    """The worker's scores of `_batch()` in this world's layout (None off the last stage)."""
    from rl3d.config import load_config
    from rl3d.data import load_tokenizer
    from rl3d.models.spec import get_model_spec
    from rl3d.workers.context import RoleContext
    from rl3d.workers.reward_model import RewardModelWorker

    cfg = load_config(
        PPO_RM, [f"reward.model.path={weights}", "reward.model.micro_batch_size=4", *overrides]
    ).config
    spec = get_model_spec("tiny-llama")
    ctx = RoleContext(cfg, spec, groups, load_tokenizer(None, vocab_size=spec.vocab_size))
    out = RewardModelWorker(ctx, kind="reward").compute_score(_batch())
    if out is None:  # not the last pipeline stage
        return None
    scores, metrics = out
    # the recipe's weights: score = 0 * rule + 1 * model
    assert torch.equal(scores["score"], scores["reward_model"])
    assert scores["rule_score"].tolist() == _batch()["score"].tolist()
    return scores["reward_model"].tolist(), metrics


@pytest.mark.distributed
def test_reward_model_scores_agree_across_layouts(tmp_path):
    weights = tmp_path / "rm"
    ((ref, packed),) = run_distributed(_save_random_model, 1, str(weights), timeout_s=300)  # at tp=1
    # packed without pads, under a 16-token budget that regroups the sequences
    assert max(abs(a - b) for a, b in zip(packed[0], ref[0], strict=True)) < 1e-5
    tp2 = run_distributed(_score, 2, str(weights), 1, 2, timeout_s=300)
    pp2 = run_distributed(_score, 2, str(weights), 2, 1, timeout_s=300)
    assert pp2[0] is None  # the first stage has no scores; the last stage's ranks all do
    assert tp2[0] == tp2[1]  # the value head is replicated over TP
    ref_scores, ref_metrics = ref
    assert max(abs(s) for s in ref_scores) > 0.1  # a real signal, not a near-zero head
    for scores, metrics in (tp2[0], pp2[1]):
        assert max(abs(a - b) for a, b in zip(scores, ref_scores, strict=True)) < 1e-5
        assert metrics["reward/rule_mean"] == pytest.approx(0.5)
    _hf_export_scores_alike(weights, tmp_path / "hf", ref_scores)


def _hf_export_scores_alike(weights, dst, ref_scores):
    """`rl3d export`'s form of a reward model, an HF LlamaForSequenceClassification, gives the
    same scores (each sequence unpadded; fp32, a different attention kernel: within 1e-4)."""
    from transformers import AutoModelForSequenceClassification

    from rl3d.workers.reward_model import export_reward_model_hf

    export_reward_model_hf(weights, dst)
    model = AutoModelForSequenceClassification.from_pretrained(dst, dtype=torch.float32).eval()
    batch = _batch()
    for i, ref in enumerate(ref_scores):
        ids = batch["input_ids"][i][batch["attention_mask"][i].bool()]
        with torch.no_grad():
            assert abs(model(ids[None]).logits.item() - ref) < 1e-4
