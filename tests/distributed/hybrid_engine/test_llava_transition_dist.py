"""LLaVA's train -> generate transition over gloo, into the torch engine.

Two ranks hold the t=2 training shards of a tiny random LLaVA (the decoder's, the CLIP tower's
and the projector's, split as megatron-core trains them: `llava_params`). The executor moves
them to t_g=1 (each rank receives the other's shards) and t_g=2 (nothing moves): the bytes each
rank counts equal the planned bytes, and `LlavaRolloutEngine` on the resulting GenerationWeights
(at t_g=2: the tower's and projector's matmuls piece by piece, all-reduced over the generation-TP
group) generates the tokens and log-probs of the engine on the whole tensors."""

import pytest
import torch

from rl3d.testing.spawn import run_distributed

pytestmark = [pytest.mark.distributed]

IMAGE = 250
PROMPTS = [[1, 7, IMAGE, 11, 12], [1, IMAGE, 9, 40, IMAGE, 13], [5, 6, 7]]


def _images():
    gen = torch.Generator().manual_seed(3)
    return [torch.randn(k, 3, 16, 16, generator=gen) if k else None for k in (1, 2, 0)]


def worker(rank, world, hf_tensors, hf_config):
    from rl3d.hybrid_engine.executor import Resharder
    from rl3d.hybrid_engine.vision_plan import llava_params, plan_llava_transition
    from rl3d.hybrid_engine.weights import training_shards
    from rl3d.models.llava import llava_spec_from_hf_config
    from rl3d.models.llava_mapping import llava_to_megatron
    from rl3d.parallel import GenerationLayout, ParallelLayout
    from rl3d.parallel.groups import build_hybrid_groups
    from rl3d.parallel.sharding import padded_vocab_size
    from rl3d.rollout import SamplingParams
    from rl3d.rollout.vision import LlavaRolloutEngine

    spec, train = llava_spec_from_hf_config(hf_config), ParallelLayout(1, 2, 1)
    full = llava_to_megatron(spec, hf_tensors, padded_vocab=padded_vocab_size(spec.text.vocab_size, 2))
    params = llava_params(spec, train_tp=2)
    shards = training_shards(
        full, params, pp_rank=0, pp=1, tp_rank=rank, tp=2, num_layers=spec.text.num_layers
    )
    sampling = SamplingParams(max_new_tokens=6, n=2, seed=5)
    whole = LlavaRolloutEngine(spec, full).generate(PROMPTS, sampling, images=_images())
    out = {"whole": (whole.response_ids, whole.logprobs)}
    for t_g in (1, 2):
        groups = build_hybrid_groups(GenerationLayout.from_training(train, t_g), timeout_s=60)
        resharder = Resharder(spec.text, groups, params=params, dtype=torch.float32)
        weights = resharder.to_generation(shards)
        planned = plan_llava_transition(spec, train, t_g, dtype="float32")
        cost = {r.rank: r for r in planned.strategies["hybridflow"].ranks}[rank]
        stats = resharder.last_stats
        vision = sum(p[0].numel() for n, p in weights.pieces.items() if not n.startswith("language_model."))
        out[(t_g, "bytes")] = (stats.recv_bytes, cost.recv_bytes, stats.send_bytes, cost.send_bytes, vision)
        engine = LlavaRolloutEngine(spec, weights, group=groups.gen_tp)
        batch = engine.generate(PROMPTS, sampling, images=_images())
        out[t_g] = (batch.response_ids, batch.logprobs, batch.metrics["rollout/images_encoded"])
    return out


def test_llava_transition_bytes_and_engine():
    from rl3d.testing.tiny_hf import make_tiny_llava

    hf = make_tiny_llava(seed=5, image_token_id=IMAGE)
    tensors = {n: t.detach().clone() for n, t in hf.state_dict().items()}
    results = run_distributed(worker, 2, tensors, hf.config.to_dict(), timeout_s=300)
    for rank in range(2):
        ids, logprobs = results[rank]["whole"]
        for t_g in (1, 2):
            recv, planned_recv, send, planned_send, vision = results[rank][(t_g, "bytes")]
            assert recv == planned_recv and send == planned_send, (rank, t_g)
            assert (recv > 0) == (t_g == 1) and vision > 0, (rank, t_g)
            got_ids, got_logprobs, encoded = results[rank][t_g]
            assert torch.equal(got_ids, ids), (rank, t_g)
            assert (got_logprobs - logprobs).abs().max().item() < 1e-5, (rank, t_g)
            assert encoded == 3.0
