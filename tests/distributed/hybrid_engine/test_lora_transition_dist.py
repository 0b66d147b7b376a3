"""The adapter-only transition over gloo, into the torch engine.

Two ranks hold the training shards of the base and of the adapters (split as the actor trains
them), at t=2 or at p=2 (each stage its layers' adapters). The executor moves the adapters alone
to the generation layout (t_g=1 and t_g=2 from t=2; t_g=1 from p=2, where each rank receives the
other stage's layers): the bytes each rank counts equal the planned bytes, and the engine, loading
the base once and then the transition's adapter shards, generates the same tokens and log-probs as
with the whole PEFT tensors, in the apply and the merge mode.
"""

import pytest
import torch

PROMPTS = [[5, 17, 3], [200, 9, 31, 44, 2, 7, 99], [64]]


def transition_worker(rank, world, full, tensors, config, train_pdt, t_gs):
    from rl3d.hybrid_engine.executor import Resharder
    from rl3d.hybrid_engine.lora_plan import lora_params, plan_lora_transition
    from rl3d.hybrid_engine.params import model_params
    from rl3d.hybrid_engine.weights import training_shards
    from rl3d.models.spec import get_model_spec
    from rl3d.parallel import GenerationLayout, ParallelLayout
    from rl3d.parallel.groups import build_hybrid_groups
    from rl3d.rollout import SamplingParams, TorchRolloutEngine

    spec, train = get_model_spec("tiny-llama"), ParallelLayout(*train_pdt)
    at = dict(pp_rank=train.coords(rank).pp, pp=train.p, tp_rank=train.coords(rank).tp, tp=train.t,
              num_layers=spec.num_layers)  # fmt: skip
    base_params, adapter_params = model_params(spec, train_tp=train.t), lora_params(spec, config["r"])
    base = training_shards(full, base_params, **at)
    adapters = training_shards(tensors, adapter_params, **at)
    out = {}
    for t_g in t_gs:
        groups = build_hybrid_groups(GenerationLayout.from_training(train, t_g), timeout_s=60)
        weights = Resharder(spec, groups, dtype=torch.float32).to_generation(base)
        moved = Resharder(spec, groups, params=adapter_params, dtype=torch.float32)
        generation_adapters = moved.to_generation(adapters)
        planned = plan_lora_transition(spec, train, t_g, rank=config["r"], dtype="float32").lora
        cost = {r.rank: r for r in planned.strategies["hybridflow"].ranks}[rank]
        stats = moved.last_stats
        out[(t_g, "bytes")] = (stats.recv_bytes, cost.recv_bytes, stats.send_bytes, cost.send_bytes)
        params = SamplingParams(max_new_tokens=6, n=2, seed=5)
        for mode in ("apply", "merge"):
            engine = TorchRolloutEngine(spec, weights, group=groups.gen_tp, lora_mode=mode)
            engine.load_lora(generation_adapters, config)
            from_shards = engine.generate(PROMPTS, params)
            engine.load_lora(tensors, config)
            from_whole = engine.generate(PROMPTS, params)
            out[(t_g, mode)] = (
                from_shards.response_ids,
                from_shards.logprobs,
                from_whole.response_ids,
                from_whole.logprobs,
            )
    return out


@pytest.mark.distributed
@pytest.mark.parametrize(("train_pdt", "t_gs"), [((1, 2, 1), (1, 2)), ((2, 1, 1), (1,))], ids=["tp2", "pp2"])
def test_adapter_transition_bytes_and_engine(tmp_path, train_pdt, t_gs):
    from rl3d.hybrid_engine.params import model_params
    from rl3d.models.spec import get_model_spec
    from rl3d.testing.lora import megatron_from_hf, peft_adapter
    from rl3d.testing.spawn import run_distributed
    from rl3d.testing.tiny_hf import make_tiny_hf_model

    spec = get_model_spec("tiny-llama")
    model = make_tiny_hf_model(spec, seed=2)
    full = megatron_from_hf(spec, model, model_params(spec, train_tp=train_pdt[1])[0].shape[0])
    _, tensors, config = peft_adapter(model, tmp_path, rank=4, alpha=8)
    results = run_distributed(transition_worker, 2, full, tensors, config, train_pdt, t_gs, timeout_s=240)
    for rank in range(2):
        for t_g in t_gs:
            recv, planned_recv, send, planned_send = results[rank][(t_g, "bytes")]
            assert recv == planned_recv and send == planned_send, (rank, t_g)
            # nothing moves only at t_g = t and p = 1, where each rank already holds its shard
            assert (recv > 0) == (t_g != train_pdt[1] or train_pdt[0] > 1), (rank, t_g)
            for mode in ("apply", "merge"):
                ids, logprobs, ids_whole, logprobs_whole = results[rank][(t_g, mode)]
                assert torch.equal(ids, ids_whole), (rank, t_g, mode)
                assert torch.equal(logprobs, logprobs_whole), (rank, t_g, mode)
