"""The `rl3d` console script: routing, exit codes, and messages on stderr."""

import subprocess
import sys
from pathlib import Path

from rl3d.cli import EXIT_BAD_INPUT, main

ROOT = Path(__file__).resolve().parents[2]
GRPO = str(ROOT / "recipes/quickstart_cpu_grpo.yaml")


def test_validate_bad_override_exits_2_and_names_key(capsys):
    assert main(["validate", GRPO, "rollout.t_g=4"]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert "command line: rollout.t_g" in err and "must divide training t=2" in err


def test_train_validates_before_launching(capsys):
    assert main(["train", GRPO, "trainer.bogus=1"]) == EXIT_BAD_INPUT
    assert "trainer.bogus: unknown key" in capsys.readouterr().err


def test_train_dry_run_prints_torchrun_command(capsys):
    assert main(["train", GRPO, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "--nproc-per-node=2" in out and "rl3d.train" in out and "1-2-1" in out


def test_console_script_is_installed():
    exe = Path(sys.executable).with_name("rl3d")
    proc = subprocess.run([str(exe), "validate", GRPO], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "tiny-llama" in proc.stdout


def test_validate_prints_the_resource_pools(capsys):
    ppo = str(ROOT / "recipes/quickstart_cpu_ppo.yaml")
    own = ["critic.colocate=false", "critic.parallel.tp=1", "critic.parallel.dp=2", "launch.nproc_per_node=4"]
    assert main(["validate", ppo, *own]) == 0
    out = capsys.readouterr().out
    assert "# pool actor: world ranks 0-1, p-t-d 1-2-1, hosts actor, reference\n" in out
    assert "# pool critic: world ranks 2-3, p-t-d 1-1-2, hosts critic\n" in out


def test_plan_auto_place_is_the_deprecated_name_of_auto_layout(capsys):
    args = ["plan", GRPO, "--gpus", "2", "--top", "2", "--json"]
    assert main([*args, "--auto-layout"]) == 0
    new = capsys.readouterr()
    assert main([*args, "--auto-place"]) == 0
    old = capsys.readouterr()
    assert old.out == new.out and "candidates" in new.out and new.err == ""
    assert "--auto-place is deprecated, use --auto-layout" in old.err
