"""`rl3d slurm` without a cluster: the scripts it writes (checked by `bash -n`) and its errors."""

import argparse
import shutil
import subprocess
from pathlib import Path

import pytest

import yaml
from rl3d.config import ConfigError, load_config
from rl3d.launch.slurm import add_slurm_arguments, run_slurm
from rl3d.launch.slurm_job import preflight

ROOT = Path(__file__).resolve().parents[3]
QUICKSTART = str(ROOT / "recipes/quickstart_cpu_grpo.yaml")
LLAMA_70B = str(ROOT / "recipes/gpu_llama2_70b_grpo.yaml")


def slurm_cli(argv: list[str]) -> int:
    """`rl3d slurm ARGV`, through the same argparse wiring the `rl3d` command uses."""
    parser = argparse.ArgumentParser(prog="rl3d")
    sub = parser.add_subparsers(dest="command", required=True)
    add_slurm_arguments(sub.add_parser("slurm"))
    args = parser.parse_args(["slurm", *argv])
    return run_slurm(args)


def bash_n(path: Path) -> None:
    proc = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, f"{path.name}: {proc.stderr}"


def sbatch_options(script: str) -> list[str]:
    return [line.removeprefix("#SBATCH ") for line in script.splitlines() if line.startswith("#SBATCH ")]


def test_cpu_one_node_two_ranks_script_passes_bash_n(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert slurm_cli([QUICKSTART, "--nodes", "1", f"trainer.run_dir={run_dir}", "--dry-run"]) == 0
    printed = capsys.readouterr().out
    batch, node = run_dir / "slurm/job.sbatch", run_dir / "slurm/node.sh"
    bash_n(batch)
    bash_n(node)
    assert batch.read_text() in printed and "not submitted" in printed
    opts = sbatch_options(batch.read_text())
    assert {"--nodes=1", "--ntasks-per-node=1", "--cpus-per-task=2", "--requeue"} <= set(opts)
    assert "--signal=B:USR1@120" in opts and not any(o.startswith("--gpus") for o in opts)
    text = batch.read_text()
    assert 'scontrol show hostnames "$SLURM_JOB_NODELIST"' in text
    assert 'scontrol requeue "$SLURM_JOB_ID"' in text and 'exit "$rc"' in text
    assert f"{run_dir}/slurm/logs/job%j-batch.log" in text and "node%n.log" in text
    node_text = node.read_text()
    assert "--nproc-per-node=2" in node_text and "--rdzv-backend=c10d" in node_text
    assert (
        '--rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT"' in node_text and '--nnodes="$SLURM_NNODES"' in node_text
    )
    resolved = run_dir / "slurm/resolved_config.yaml"
    assert '-m rl3d.train "$RESOLVED"' in node_text and f"RESOLVED={resolved}" in node_text
    assert "QUICKSTART" not in node_text and "quickstart_cpu_grpo.yaml" not in node_text.split("RESOLVED=")[1]
    # the job's recipe is the resolved one, with the launch shape and the absolute run dir in it
    cfg = load_config(resolved).config
    assert (cfg.launch.nnodes, cfg.launch.nproc_per_node) == (1, 2)
    assert cfg.trainer.run_dir == str(run_dir)
    assert not (run_dir / "slurm/job_id").exists()


def test_llama2_70b_on_8_nodes_of_8_gpus(tmp_path):
    run_dir = tmp_path / "run70b"
    assert slurm_cli([LLAMA_70B, "--nodes", "8", "--dry-run", f"trainer.run_dir={run_dir}"]) == 0
    batch, node = run_dir / "slurm/job.sbatch", run_dir / "slurm/node.sh"
    bash_n(batch)
    bash_n(node)
    opts = sbatch_options(batch.read_text())
    assert {"--nodes=8", "--gpus-per-node=8", "--partition=gpu", "--time=24:00:00"} <= set(opts)
    assert not any(o.startswith("--cpus-per-task") for o in opts)
    assert "export NCCL_SOCKET_IFNAME=ib0" in batch.read_text()
    assert "--nproc-per-node=8" in node.read_text() and "--device=cuda" in node.read_text()
    cfg = load_config(run_dir / "slurm/resolved_config.yaml").config
    assert cfg.launch.world_size == 64 and cfg.launch.slurm.time == "24:00:00"


def test_ray_backend_script_starts_head_workers_driver_and_stops(tmp_path):
    run_dir = tmp_path / "ray"
    # SGLang spans t_g GPUs, more than a Ray rank actor holds: the Ray script runs the torch engine
    argv = [LLAMA_70B, "--nodes", "8", "--dry-run", "launch.backend=ray", "rollout.engine=torch"]
    argv.append(f"trainer.run_dir={run_dir}")
    assert slurm_cli(argv) == 0
    batch = run_dir / "slurm/job.sbatch"
    bash_n(batch)
    text = batch.read_text()
    assert "start --head" in text and '--exclude="$HEAD_NODE"' in text and "--nodes=7 --ntasks=7" in text
    assert "wait-ray --nodes=8" in text and "RAY_AUTH_TOKEN_PATH" in text
    assert "stop_ray" in text and "export RAY_ADDRESS" in text
    assert '-m rl3d.cli train "$SLURM_DIR/resolved_config.yaml"' in text  # the Ray driver
    assert not (run_dir / "slurm/node.sh").exists()


def test_site_settings_container_modules_and_flags(tmp_path):
    run_dir = tmp_path / "site"
    argv = [
        LLAMA_70B, "--nodes", "16", "--gpus-per-node", "4", "--partition", "a100", "--account", "proj",
        "--time", "01:30:00", "--container-image", "nvcr.io/nvidia/pytorch:25.01-py3", "--no-requeue",
        "--sbatch-arg=--exclusive", "--dry-run", f"trainer.run_dir={run_dir}",
        "launch.slurm.modules=[cuda/12.4, nccl]", "launch.slurm.container_mounts=[/data:/data]",
    ]  # fmt: skip
    assert slurm_cli(argv) == 0
    batch = run_dir / "slurm/job.sbatch"
    bash_n(batch)
    text = batch.read_text()
    opts = sbatch_options(text)
    assert {
        "--nodes=16",
        "--gpus-per-node=4",
        "--partition=a100",
        "--account=proj",
        "--time=01:30:00",
    } <= set(opts)
    assert "--no-requeue" in opts and "--exclusive" in opts and "scontrol requeue" not in text
    assert "module load cuda/12.4" in text and "module load nccl" in text
    assert "--container-image=nvcr.io/nvidia/pytorch:25.01-py3" in text
    assert f"--container-mounts=/data:/data,{run_dir}:{run_dir}" in text
    assert "PYTHON=python" in (run_dir / "slurm/node.sh").read_text()


def test_nodes_times_gpus_must_match_world_size(tmp_path, capsys):
    assert slurm_cli([LLAMA_70B, "--nodes", "4", "--dry-run", f"trainer.run_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert "--nodes 4 x 8 GPUs per node = 32 ranks does not match the recipe's world size 64" in err
    assert "use --nodes 8" in err
    assert not (tmp_path / "slurm").exists()


def test_cpu_recipe_rejects_gpus_and_uneven_nodes(tmp_path, capsys):
    assert slurm_cli([QUICKSTART, "--gpus-per-node", "2", "--dry-run", f"trainer.run_dir={tmp_path}"]) == 2
    assert "CPU recipe" in capsys.readouterr().err
    assert slurm_cli([QUICKSTART, "--nodes", "3", "--dry-run", f"trainer.run_dir={tmp_path}"]) == 2
    assert "--nodes 3 does not divide the recipe's world size 2" in capsys.readouterr().err


def test_bad_override_fails_before_anything_is_written(tmp_path):
    with pytest.raises(ConfigError, match="trainer.total_steps"):
        slurm_cli([QUICKSTART, "--dry-run", f"trainer.run_dir={tmp_path / 'r'}", "trainer.total_steps=abc"])
    assert not (tmp_path / "r").exists()


def test_missing_sbatch_is_a_clear_error(tmp_path, monkeypatch, capsys):
    empty = tmp_path / "empty_bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    assert shutil.which("sbatch") is None
    assert slurm_cli([QUICKSTART, f"trainer.run_dir={tmp_path / 'r'}"]) == 2
    assert "sbatch is not on the PATH" in capsys.readouterr().err
    assert not (tmp_path / "r/slurm/job_id").exists()


def test_status_and_cancel_need_a_recorded_job(tmp_path, capsys):
    assert slurm_cli(["status", str(tmp_path)]) == 2
    assert "no SLURM job recorded" in capsys.readouterr().err
    assert slurm_cli(["cancel"]) == 2
    assert "usage: rl3d slurm cancel RUN_DIR" in capsys.readouterr().err


def test_status_falls_back_to_the_run_history(tmp_path, monkeypatch, capsys):
    (tmp_path / "slurm").mkdir()
    (tmp_path / "slurm/job_id").write_text("41\n")
    (tmp_path / "slurm/history.log").write_text("2026-01-01T00:00:00Z job=41 restart=0 end rc=1\n")
    monkeypatch.setenv("PATH", str(tmp_path))  # no scontrol, no sacct
    assert slurm_cli(["status", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "job      41  UNKNOWN" in out and "end rc=1" in out


def test_preflight_names_missing_inputs(tmp_path):
    run_dir = tmp_path / "run"
    assert slurm_cli([QUICKSTART, "--dry-run", f"trainer.run_dir={run_dir}"]) == 0
    resolved = run_dir / "slurm/resolved_config.yaml"
    assert preflight(str(resolved), 2, "cpu") == []
    data = yaml.safe_load(resolved.read_text())
    data["data"]["train_files"] = [str(tmp_path / "nope.parquet")]
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(data))
    assert preflight(str(bad), 2, "cpu") == [
        f"data.train_files[0]: {tmp_path / 'nope.parquet'} (not found on this node)"
    ]


@pytest.mark.parametrize("block", sorted((ROOT / "yaml/clusters").glob("slurm_*.yaml")), ids=lambda p: p.stem)
def test_every_slurm_cluster_block_gives_a_valid_script(block, tmp_path, monkeypatch):
    monkeypatch.setenv("RL3D_YAML_DIR", str(ROOT / "yaml"))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        f"defaults: [models/tiny_llama, algos/grpo, rollout/torch_cpu, clusters/{block.stem}]\n"
        "actor: {parallel: {tp: 2, dp: 8}, mini_batch_size: 16, micro_batch_size: 1}\n"
        "rollout: {n: 2}\n"
        "data: {synthetic: {task: copy_first}, prompts_per_step: 8}\n"
        "launch: {nnodes: 2}\n"
    )
    run_dir = tmp_path / "run"
    assert slurm_cli([str(recipe), "--dry-run", f"trainer.run_dir={run_dir}"]) == 0
    bash_n(run_dir / "slurm/job.sbatch")
    bash_n(run_dir / "slurm/node.sh")
    opts = sbatch_options((run_dir / "slurm/job.sbatch").read_text())
    assert "--nodes=2" in opts and "--gpus-per-node=8" in opts
