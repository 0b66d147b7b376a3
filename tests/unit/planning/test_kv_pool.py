"""SGLang's KV pool comes from the memory plan: `rollout.sglang.max_total_tokens: plan` (the
default) is resolved by `rl3d train` into the tokens the plan's generate phase leaves on the
device, and reaches SGLang as `max_total_tokens` (the server-args contract test pins the name)."""

import pytest

from rl3d.config import ConfigError, load_config
from rl3d.launch.preflight_memory import kv_pool_override
from rl3d.launch.train import launch_train
from rl3d.models.spec import spec_of
from rl3d.planning.memory import ENGINE, plan_memory, sglang_kv_tokens

GPU_7B = "recipes/gpu_llama2_7b_grpo.yaml"
QUICKSTART = "recipes/quickstart_cpu_grpo.yaml"
GIB = 1 << 30
REPORTED_80GB = int(79.1 * GIB)  # what an "80 GB" card reports to CUDA


def test_the_setting_is_plan_by_default_and_checked():
    cfg = load_config(GPU_7B).config
    assert cfg.rollout.sglang.max_total_tokens == "plan"
    fixed = load_config(GPU_7B, ["rollout.sglang.max_total_tokens=1234"]).config
    assert fixed.rollout.sglang.max_total_tokens == 1234
    with pytest.raises(ConfigError, match="rollout.sglang.max_total_tokens"):
        load_config(GPU_7B, ["rollout.sglang.max_total_tokens=0"])
    with pytest.raises(ConfigError, match="rollout.sglang.max_total_tokens"):
        load_config(GPU_7B, ["rollout.sglang.max_total_tokens=auto"])


def test_tokens_are_the_plans_kv_pool_over_one_tokens_kv_bytes():
    cfg = load_config(GPU_7B).config
    spec = spec_of(cfg.model)
    t_g = cfg.rollout.t_g
    # K and V of one token on one generation rank: every layer, its share of the KV heads, bf16
    per_token = spec.num_layers * (spec.num_query_groups // t_g) * 2 * spec.head_dim * 2
    plan = plan_memory(cfg, REPORTED_80GB)
    pools = [r.phases["generate"][ENGINE].kv_cache for r in plan.ranks if "generate" in r.phases]
    assert pools and all(b > 0 for b in pools)
    tokens = sglang_kv_tokens(cfg, REPORTED_80GB)
    assert tokens == min(pools) // per_token
    # a full-length sequence fits, and a bigger device leaves at least as large a pool
    assert tokens >= cfg.data.max_prompt_length + cfg.rollout.max_new_tokens
    assert sglang_kv_tokens(cfg, 140 * GIB) >= tokens


def test_train_writes_the_plans_number_into_the_ranks_overrides(tmp_path):
    """The quickstart with SGLang on a (stated) 8 GiB GPU (contexts, NCCL and
    SGLang's CUDA graphs take 3 GiB of it): a dry run shows the ranks' command."""
    lines: list[str] = []
    overrides = ["rollout.engine=sglang", "launch.device=cuda", f"trainer.run_dir={tmp_path / 'run'}"]
    assert launch_train(QUICKSTART, overrides, emit=lines.append, dry_run=True, device_gib=8) == 0
    tokens = sglang_kv_tokens(load_config(QUICKSTART, overrides).config, 8 * GIB)
    expected = f"rollout.sglang.max_total_tokens={tokens}"
    command = next(line for line in lines if line.startswith("command"))
    assert command.endswith(expected) and any(line.startswith(f"memory plan  {expected}") for line in lines)


def test_nothing_to_resolve_without_sglang_a_set_value_or_a_device_size():
    assert kv_pool_override(load_config(GPU_7B, ["rollout.engine=torch"])) is None
    assert kv_pool_override(load_config(GPU_7B, ["rollout.sglang.max_total_tokens=99"]), 80) is None
    assert kv_pool_override(load_config(GPU_7B)) is None  # no GPU here and no --device-gib: no size known
