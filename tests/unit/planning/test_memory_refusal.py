"""Preflight refuses a recipe whose memory plan does not fit the device, on CPU with an explicit
device size: exit 2 and one line naming the rank, phase, role, biggest item and a remedy."""

import pytest

from rl3d.cli import main
from rl3d.config import load_config
from rl3d.launch.preflight_memory import MemoryPlanError, check_memory
from rl3d.planning import plan_memory
from rl3d.planning.memory_report import refusal

RECIPE = "recipes/quickstart_cpu_ppo.yaml"
GIB = 1 << 30


def test_refusal_names_rank_phase_role_item_and_remedy():
    loaded = load_config(RECIPE, [])
    worst = plan_memory(loaded.config, device_bytes=1 << 40).worst()  # on a GPU: its allowances too
    with pytest.raises(MemoryPlanError) as err:
        check_memory(loaded, device_gib=worst.peak_bytes / GIB * 0.99)
    line = str(err.value)
    assert "\\n" not in line
    assert f"rank {worst.rank} (node 0)" in line and f"in its {worst.peak_phase} phase" in line
    assert "biggest item: actor activations" in line
    assert "actor.packing: true" in line and "actor.micro_batch_size" in line
    check_memory(loaded, device_gib=worst.peak_bytes / GIB)  # exactly the peak fits
    check_memory(loaded, device_gib=None)  # a CPU run without a device size is not checked


def test_refusal_names_the_kv_cache():
    small_batches = ["actor.micro_batch_size=1", "critic.micro_batch_size=1"]
    cfg = load_config(RECIPE, ["rollout.n=16", "rollout.max_new_tokens=256", *small_batches]).config
    line = refusal(plan_memory(cfg, device_bytes=plan_memory(cfg).worst().peak_bytes - 1))
    assert "generate phase" in line and "biggest item: engine kv_cache" in line and "rollout.t_g" in line


@pytest.mark.parametrize("command", ["validate", "train"])
def test_cli_exits_2_on_a_plan_that_does_not_fit(command, capsys, tmp_path):
    extra = ["--dry-run"] if command == "train" else []
    run_dir = f"trainer.run_dir={tmp_path / 'run'}"
    assert main([command, RECIPE, run_dir, "--device-gib", "0.001", *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "memory plan: rank 0" in err[0] and "0.00 GiB" not in err[0]
    assert main([command, RECIPE, run_dir, "--device-gib", "4", *extra]) == 0
