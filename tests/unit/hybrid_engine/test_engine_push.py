"""The push to an engine that takes whole HF tensors (SGLang), a step of the transition's plan:
its buckets are the ones the SGLang adapter built on its own before (same tensors, order and
sizes, for tiny models and a SmolLM2-shaped spec); the bytes gathered to make whole tensors are
the other generation-TP ranks' shards; the executor counts the push into `reshard/*` and raises
on a push that is not the plan; the torch engine pushes nothing and counts zeros."""

from types import SimpleNamespace

import pytest
import torch

from rl3d.hybrid_engine.comm import ReshardError
from rl3d.hybrid_engine.engine_push import NO_PUSH, plan_engine_push, push_mismatch
from rl3d.hybrid_engine.params import model_params
from rl3d.hybrid_engine.weights import GenerationWeights, full_model, training_shards
from rl3d.models.hf_mapping import tensor_maps
from rl3d.models.spec import ModelSpec, get_model_spec
from rl3d.ops.layouts import shard_for_tp
from rl3d.rollout.sglang_weights import Pushed, megatron_to_hf, planned_buckets
from rl3d.testing.spawn import one_rank_world

# SmolLM2-135M's shape (its HF config.json): tied embeddings, 9 heads over 3 KV heads
SMOLLM2 = ModelSpec(
    name="smollm2-135m-shape",
    num_layers=30,
    hidden_size=576,
    ffn_hidden_size=1536,
    num_attention_heads=9,
    num_query_groups=3,
    vocab_size=49152,
    tied_embeddings=True,
)
MiB = 2**20


def former_plan_buckets(named_tensors, bucket_bytes):
    """The SGLang adapter's own bucketing before the push was planned (`plan_buckets`, as it
    was): a stream of tensors, in order, into buckets of at most `bucket_bytes` and one dtype."""
    bucket, size = [], 0
    for name, t in named_tensors:
        nbytes = t.numel() * t.element_size()
        if bucket and (size + nbytes > bucket_bytes or t.dtype != bucket[0][1].dtype):
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += nbytes
    if bucket:
        yield bucket


def _layout(buckets):
    return [[(n, tuple(t.shape), t.numel() * t.element_size()) for n, t in b] for b in buckets]


def _planned(plan):
    return [[(t.name, t.shape, t.nbytes) for t in b.tensors] for b in plan.buckets]


def _full(spec, tp):
    params = model_params(spec, train_tp=tp)
    full = full_model(params, seed=2, dtype=torch.float32)
    return params, {p.name: full[p.name] for p in params if not p.tied_copy}


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-llama-odd-vocab", "tiny-qwen3-moe"])
@pytest.mark.parametrize("bucket_bytes", [1, 20_000, 512 * MiB])
def test_tiny_models_buckets_are_the_former_ones(name, bucket_bytes):
    """The adapter's stream was every parameter's HF tensors in the transition's order."""
    spec = get_model_spec(name)
    params, full = _full(spec, tp=1)
    stream = [pair for mname, t in full.items() for pair in megatron_to_hf(spec, mname, [t])]
    plan = plan_engine_push(spec, params, 1, dtype="float32", bucket_bytes=bucket_bytes)
    assert _planned(plan) == _layout(former_plan_buckets(stream, bucket_bytes))
    assert plan.gather_bytes == 0 and plan.nbytes == sum(t.numel() * 4 for _, t in stream)
    # and the engine's side fills exactly those buckets, with the very tensors
    weights = GenerationWeights(spec, {p.name: p for p in params}, 1, 1, 0, {n: [t] for n, t in full.items()})
    pushed = Pushed()
    for bucket in planned_buckets(spec, weights, plan.buckets, pushed=pushed):
        pushed.add(bucket)
        for hf_name, tensor in bucket:
            assert torch.equal(tensor, dict(stream)[hf_name]), hf_name
    assert push_mismatch(plan, pushed) is None


@pytest.mark.parametrize("bucket_mb", [16, 64, 512])
def test_smollm2_shaped_buckets_are_the_former_ones(bucket_mb):
    """bf16, on meta tensors: each parameter through its HF conversion (`tensor_maps`)."""
    params = model_params(SMOLLM2, train_tp=1)
    maps = {m.mcore: m for m in tensor_maps(SMOLLM2, padded_vocab=params[0].shape[0])}
    stream = []
    for p in params:
        if p.tied_copy:
            continue
        tensors = maps[p.name].to_hf(torch.empty(p.shape, dtype=torch.bfloat16, device="meta"))
        stream += zip(p.hf, tensors)
    plan = plan_engine_push(SMOLLM2, params, 1, dtype="bfloat16", bucket_bytes=bucket_mb * MiB)
    assert _planned(plan) == _layout(former_plan_buckets(stream, bucket_mb * MiB))
    assert "lm_head.weight" not in {t.name for b in plan.buckets for t in b.tensors}  # tied
    assert plan.num_tensors == 30 * 9 + 2 and (len(plan.buckets) > 1) == (bucket_mb < 512)


@pytest.mark.parametrize("name,t_g", [("tiny-llama", 2), ("tiny-llama", 4), ("tiny-qwen2", 2)])
def test_gather_bytes_are_the_other_ranks_shards(name, t_g):
    """Each generation rank receives its t_g - 1 peers' shard of every sharded parameter."""
    spec = get_model_spec(name)
    params, full = _full(spec, tp=t_g)
    want = sum(
        (t_g - 1) * shard_for_tp(full[p.name], p.kind, t_g, 0).numel() * 4
        for p in params
        if p.name in full and p.kind.value != "replicated"
    )
    plan = plan_engine_push(spec, params, t_g, dtype="float32", bucket_bytes=MiB)
    assert plan.gather_bytes == want > 0
    assert plan.nbytes == plan_engine_push(spec, params, 1, dtype="float32", bucket_bytes=MiB).nbytes


def test_mismatch_says_which_bucket():
    spec = get_model_spec("tiny-llama")
    plan = plan_engine_push(spec, model_params(spec, train_tp=1), 1, dtype="float32", bucket_bytes=20_000)
    good = [(b.names, b.nbytes) for b in plan.buckets]
    assert push_mismatch(plan, Pushed(list(good), 0)) is None
    short = Pushed([*good[:2], (good[2][0], good[2][1] - 4), *good[3:]], 0)
    names = ", ".join(good[2][0])
    said = push_mismatch(plan, short)
    assert f"bucket 2 differs: pushed 2 tensors ({names}), {good[2][1] - 4} bytes" in said
    assert f"the plan has {plan.nbytes} bytes in {len(good)}" in push_mismatch(plan, Pushed(good[:-1], 0))
    assert push_mismatch(plan, None).startswith("the engine push moved 0 bytes in 0 buckets")
    assert "gathered 8 bytes" in push_mismatch(plan, Pushed(list(good), 8))
    assert push_mismatch(NO_PUSH, None) is None and NO_PUSH.summary()["bytes"] == 0


def test_a_plan_for_another_model_fails_while_filling():
    spec = get_model_spec("tiny-llama")
    params, full = _full(spec, tp=1)
    weights = GenerationWeights(spec, {p.name: p for p in params}, 1, 1, 0, {n: [t] for n, t in full.items()})
    other = get_model_spec("tiny-llama-odd-vocab")  # same names, another vocabulary
    plan = plan_engine_push(other, model_params(other, train_tp=1), 1, dtype="float32", bucket_bytes=MiB)
    with pytest.raises(RuntimeError, match="model.embed_tokens.weight of shape"):
        list(planned_buckets(spec, weights, plan.buckets))


# -- the executor: the push counted with the transition ---------------------------------------
@pytest.fixture(scope="module")
def hybrid_groups():
    """The hybrid groups of a 1-1-1 layout in a one-process gloo world."""
    from rl3d.parallel import GenerationLayout, ParallelLayout
    from rl3d.parallel.groups import build_hybrid_groups

    with one_rank_world():
        yield build_hybrid_groups(GenerationLayout.from_training(ParallelLayout(1, 1, 1), 1), timeout_s=60)


class HFEngine:
    """What the SGLang adapter does with the weights, without SGLang: fill the planned buckets."""

    def __init__(self, spec, plan, corrupt=None):
        self.spec, self.plan, self.corrupt, self.received = spec, plan, corrupt, []

    def load_weights(self, weights):
        pushed = Pushed()
        for k, bucket in enumerate(planned_buckets(self.spec, weights, self.plan.buckets, pushed=pushed)):
            if k == self.corrupt:
                bucket = bucket[:-1]  # a tensor lost on the way
            self.received.append([n for n, _ in bucket])
            pushed.add(bucket)
        return pushed


def _transition(spec, groups, **kwargs):
    from rl3d.hybrid_engine.executor import Resharder

    params = model_params(spec, train_tp=1)
    full = full_model(params, seed=3, dtype=torch.float32)
    shards = training_shards(full, params, pp_rank=0, pp=1, tp_rank=0, tp=1, num_layers=spec.num_layers)
    resharder = Resharder(spec, groups, dtype=torch.float32, **kwargs)
    return resharder, shards


def test_the_push_is_counted_with_the_transition(hybrid_groups):
    spec = get_model_spec("tiny-llama")
    resharder, shards = _transition(spec, hybrid_groups, push_bucket_mb=0.02)
    weights = resharder.to_generation(shards)
    plan = resharder.push_plan
    assert plan == plan_engine_push(spec, resharder.params, 1, dtype="float32", bucket_bytes=int(0.02 * MiB))
    engine = HFEngine(spec, plan)
    resharder.push(engine, weights)
    assert engine.received == [list(b.names) for b in plan.buckets] and len(plan.buckets) > 1
    m = resharder.last_stats.metrics()
    assert (m["reshard/engine_bytes"], m["reshard/engine_buckets"]) == (plan.nbytes, len(plan.buckets))
    assert m["reshard/engine_gather_bytes"] == 0 and m["reshard/engine_seconds"] > 0
    assert m["reshard/bytes"] == 0  # the transition itself is the identity here

    lost = r"rank 0: .*bucket 1 differs: pushed 1 tensors \(model.layers.0.input_layernorm.weight\)"
    with pytest.raises(ReshardError, match=lost):
        resharder.push(HFEngine(spec, plan, corrupt=1), weights)


def test_the_torch_engine_pushes_nothing(hybrid_groups):
    from rl3d.config.schema import RolloutConfig
    from rl3d.rollout import TorchRolloutEngine, push_bucket_mb

    assert push_bucket_mb(RolloutConfig(engine="torch")) is None
    assert push_bucket_mb(RolloutConfig(engine="sglang")) == RolloutConfig().sglang.bucket_mb
    from rl3d.workers.colocated_rollout import FullTransition

    spec = get_model_spec("tiny-llama")
    resharder, shards = _transition(spec, hybrid_groups)
    assert resharder.push_plan == NO_PUSH
    engine = TorchRolloutEngine(spec)
    actor = SimpleNamespace(transition_shards=lambda: shards)
    m = FullTransition(resharder).publish(actor, engine)  # the colocated actor's publish
    assert engine.weight_copy_bytes == 0 and m["reshard/peak_bytes"] == 0  # in place
    assert [m[f"reshard/engine_{k}"] for k in ("bytes", "buckets", "gather_bytes", "seconds")] == [0] * 4
    weights = resharder.to_generation(shards)
    # an engine that pushes without a plan is not the plan
    with pytest.raises(ReshardError, match="the plan has 0 bytes in 0"):
        resharder.push(HFEngine(spec, plan_engine_push(spec, resharder.params, 1, dtype="float32",
                                                       bucket_bytes=MiB)), weights)  # fmt: skip
