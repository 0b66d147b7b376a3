"""The memory plan charges SGLang's push what it holds at its peak, from the push the transition
plans (`plan_engine_push`), not `rollout.sglang.bucket_mb`: a tensor larger than a bucket is a
bucket alone, so the largest bucket can exceed the setting. Llama-2-7B's embedding (32000 x 4096
bf16, 250 MiB) at a 100 MiB bucket, generation TP 2."""

from rl3d.config import load_config
from rl3d.hybrid_engine.engine_push import plan_engine_push
from rl3d.models.params import model_params
from rl3d.models.spec import get_model_spec
from rl3d.planning import plan_memory

RECIPE = "recipes/gpu_llama2_7b_ppo.yaml"  # bf16, actor tp 4, rollout.t_g 2, hybrid_engine.bucket_mb 512
MB = 1 << 20
EMBEDDING = 32000 * 4096 * 2  # whole, as HF holds it: the largest tensor of the push
# the largest parameter gathered over the generation-TP group: the embedding (or the untied
# output layer) padded to a multiple of 128 x tp 4 rows, both of its t_g = 2 shards
GATHERED = 32256 * 4096 * 2


def test_the_largest_bucket_is_a_tensor_over_bucket_mb():
    spec = get_model_spec("llama2-7b")
    push = plan_engine_push(spec, model_params(spec, train_tp=4), 2, dtype="bfloat16", bucket_bytes=100 * MB)
    assert push.largest_bucket_bytes == EMBEDDING > 100 * MB
    assert push.largest_gathered_bytes == GATHERED
    assert push.peak_bytes == 2 * EMBEDDING + GATHERED
    assert push.summary()["peak_bytes"] == push.peak_bytes


def test_the_reshard_phase_charges_the_push_at_its_peak():
    cfg = load_config(RECIPE, ["rollout.sglang.bucket_mb=100"]).config
    engine = plan_memory(cfg).worst().phases["reshard"]["engine"]
    # the resharding bucket, then the push: the embedding's whole tensor and its flat copy, and
    # its gathered shards
    assert engine.buffers == 512 * MB + 2 * EMBEDDING + GATHERED
    # at the recipe's 512 MiB the largest bucket packs several layers' tensors: charged as planned
    default = plan_memory(load_config(RECIPE, []).config).worst().phases["reshard"]["engine"]
    assert default.buffers > engine.buffers
