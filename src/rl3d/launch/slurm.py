"""`rl3d slurm`: write an sbatch script into the run directory and submit it.

    rl3d slurm RECIPE [--nodes K] [--gpus-per-node G] [--partition P] [--account A] [--time T]
                      [--container-image IMG] [--[no-]requeue] [--dry-run] [--overwrite] [overrides]
    rl3d slurm status RUN_DIR
    rl3d slurm cancel RUN_DIR

Defaults come from the recipe's `launch.slurm` block (site settings live in `yaml/clusters/`);
flags win over it. The job runs the resolved recipe (`RUN_DIR/slurm/resolved_config.yaml`), with
`launch.nnodes`, `launch.nproc_per_node`, `trainer.run_dir` and the flags above written into it.
The job id is kept in `RUN_DIR/slurm/job_id`; `RUN_DIR/slurm/history.log` records each start,
USR1, requeue and end. The scripts and the preemption contract are in `slurm_script`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from rl3d.config import load_config, run_dir_of, write_resolved_config
from rl3d.launch.preflight import clear_run_dir, preflight
from rl3d.launch.slurm_job import missing_inputs
from rl3d.launch.slurm_script import (
    BATCH_NAME,
    HISTORY_NAME,
    JOB_ID_NAME,
    NODE_NAME,
    SLURM_SUBDIR,
    JobSpec,
    render_batch_script,
    render_node_script,
)

EXIT_BAD_INPUT = 2
ACTIVE_STATES = {"PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED", "RESIZING", "SUSPENDED"}
ACTIONS = ("status", "cancel")


class SlurmError(RuntimeError):
    """A problem `rl3d slurm` reports in one line (exit code 2): no sbatch, bad partition, ..."""


def _echo(text: str = "", *, err: bool = False) -> None:
    print(text, file=sys.stderr if err else sys.stdout)  # noqa: T201 - the CLI's own output


# -- arguments --------------------------------------------------------------------------------
def _add_options(parser: argparse.ArgumentParser, *, defaults: bool = True) -> None:
    unset = None if defaults else argparse.SUPPRESS
    add = parser.add_argument
    add("--nodes", type=int, default=unset, metavar="K", help="nodes (default: launch.nnodes)")
    add("--gpus-per-node", type=int, default=unset, metavar="G", help="default: launch.slurm.gpus_per_node")
    add("--partition", default=unset, help="default: launch.slurm.partition")
    add("--account", default=unset, help="default: launch.slurm.account")
    add("--time", default=unset, help="time limit, e.g. 24:00:00 (default: launch.slurm.time)")
    add("--container-image", default=unset, metavar="IMG", help="pyxis image (launch.slurm.container_image)")
    add(
        "--requeue", action=argparse.BooleanOptionalAction, default=unset,
        help="requeue on preemption / USR1 (default: launch.slurm.requeue)",
    )  # fmt: skip
    add("--signal-lead", type=int, default=unset, metavar="S", help="USR1 S seconds before the limit (120)")
    add(
        "--sbatch-arg", action="append", default=[] if defaults else unset, metavar="OPT",
        help="an extra #SBATCH option, e.g. --sbatch-arg=--exclusive (repeatable)",
    )  # fmt: skip
    add("--python", default=unset, help="python on the compute nodes (default: this one)")
    add("--dry-run", action="store_true", default=False if defaults else unset, help="write and print only")
    add(
        "--overwrite", action="store_true", default=False if defaults else unset,
        help="delete an earlier run's outputs in the run dir first (as `rl3d train --overwrite`)",
    )  # fmt: skip


def add_slurm_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `rl3d slurm`; flags and overrides may come in any order after the recipe."""
    parser.description = __doc__.split("\n\n")[0]
    parser.add_argument("target", metavar="RECIPE|status|cancel", help="recipe YAML, or status/cancel")
    parser.add_argument(
        "rest",
        nargs=argparse.REMAINDER,
        metavar="...",
        help="key.sub=value overrides; RUN_DIR for status/cancel",
    )
    _add_options(parser)


def parse_slurm_args(argv: list[str]) -> argparse.Namespace:
    """`rl3d slurm ARGV` parsed as `run_slurm` sees it (flags after the recipe included)."""
    parser = argparse.ArgumentParser(prog="rl3d slurm")
    add_slurm_arguments(parser)
    return _split_rest(parser.parse_args(argv))


def _split_rest(args: argparse.Namespace) -> argparse.Namespace:
    """Parse flags that followed the recipe (argparse leaves them in `rest`)."""
    late = argparse.ArgumentParser(prog="rl3d slurm", add_help=False)
    _add_options(late, defaults=False)
    late.add_argument("words", nargs="*")
    try:
        parsed = late.parse_intermixed_args(args.rest)
    except SystemExit:
        raise SlurmError(f"could not parse arguments: {' '.join(args.rest)}") from None
    merged = argparse.Namespace(**{**vars(args), **vars(parsed)})
    if "sbatch_arg" in vars(parsed):
        merged.sbatch_arg = [*args.sbatch_arg, *parsed.sbatch_arg]
    return merged


def run_slurm(args: argparse.Namespace) -> int:
    try:
        if "words" not in vars(args):
            args = _split_rest(args)
        if args.target in ACTIONS:
            if len(args.words) != 1:
                raise SlurmError(f"usage: rl3d slurm {args.target} RUN_DIR")
            return slurm_status(args.words[0]) if args.target == "status" else slurm_cancel(args.words[0])
        return submit(args.target, args.words, args)
    except SlurmError as err:
        _echo(f"rl3d slurm: {err}", err=True)
        return EXIT_BAD_INPUT


# -- submit -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Submission:
    spec: JobSpec
    batch_script: Path
    node_script: Path | None  # SPMD only; the Ray backend runs from the batch script alone


def _ranks_per_node(cfg, nodes: int, gpus_per_node: int | None) -> tuple[int, int]:
    """(ranks per node, GPUs per node); the recipe's world size must fill the nodes exactly."""
    world = cfg.launch.world_size
    par = cfg.actor.parallel
    need = f"the recipe's world size {world} (actor p*t*d = {par.pp}*{par.tp}*{par.dp}"
    need += f"{', plus the critic pool' if world != par.world_size else ''})"
    if cfg.launch.device == "cpu":
        if gpus_per_node:
            raise SlurmError(f"--gpus-per-node {gpus_per_node} with a CPU recipe (launch.device=cpu)")
        if world % nodes:
            raise SlurmError(f"--nodes {nodes} does not divide {need}")
        return world // nodes, 0
    gpus = gpus_per_node if gpus_per_node is not None else cfg.launch.slurm.gpus_per_node
    if gpus < 1 or nodes * gpus != world:
        hint = f"; use --nodes {world // gpus}" if gpus >= 1 and world % gpus == 0 else ""
        raise SlurmError(
            f"--nodes {nodes} x {gpus} GPUs per node = {nodes * gpus} ranks does not match {need}{hint}"
        )
    return gpus, gpus


def _override(key: str, value) -> str:
    return f"{key}={json.dumps(value)}"  # JSON scalars are YAML: '04:00:00' stays a string


def _job_spec(recipe: str, overrides: list[str], args: argparse.Namespace):
    cfg = load_config(recipe, overrides).config  # the user's recipe must be valid as given
    nodes = args.nodes if args.nodes is not None else cfg.launch.nnodes
    if nodes < 1:
        raise SlurmError(f"--nodes must be >= 1, got {nodes}")
    per_node, gpus = _ranks_per_node(cfg, nodes, args.gpus_per_node)
    run_dir = run_dir_of(cfg).resolve()
    pinned = {
        "launch.nnodes": nodes,
        "launch.nproc_per_node": per_node,
        "trainer.run_dir": str(run_dir),
        "launch.slurm.gpus_per_node": gpus or cfg.launch.slurm.gpus_per_node,
    }
    for flag in ("partition", "account", "time", "container_image", "requeue"):
        if getattr(args, flag) is not None:
            pinned[f"launch.slurm.{flag}"] = getattr(args, flag)
    loaded = load_config(recipe, [*overrides, *(_override(k, v) for k, v in pinned.items())])
    slurm = loaded.config.launch.slurm
    python = args.python or ("python" if slurm.container_image else sys.executable)
    spec_args = dict(
        run_dir=run_dir,
        recipe=recipe,
        job_name=f"rl3d-{loaded.config.trainer.experiment}",
        nodes=nodes,
        nproc_per_node=per_node,
        gpus_per_node=gpus,
        backend=loaded.config.launch.backend,
        workdir=Path.cwd().resolve(),
        python=python,
        partition=slurm.partition,
        account=slurm.account,
        time=slurm.time,
        requeue=slurm.requeue,
        signal_lead_s=args.signal_lead if args.signal_lead is not None else 120,
        modules=tuple(slurm.modules),
        env=dict(slurm.env),
        container_image=slurm.container_image,
        container_mounts=tuple(slurm.container_mounts),
        sbatch_args=tuple(args.sbatch_arg or ()),
    )
    try:
        return loaded, JobSpec(**spec_args)
    except ValueError as err:
        raise SlurmError(str(err)) from None


def _check_cluster(spec: JobSpec) -> None:
    if shutil.which("sbatch") is None:
        raise SlurmError(
            "sbatch is not on the PATH: run this on a SLURM login node, or add --dry-run to only "
            "write the script"
        )
    if spec.partition:
        proc = _run(["sinfo", "-h", "-o", "%R"])
        known = sorted(set(proc.stdout.split()))
        if proc.returncode != 0:
            raise SlurmError(
                f"sinfo failed, cannot check partition {spec.partition!r}: {proc.stderr.strip()}"
            )
        if spec.partition not in known:
            raise SlurmError(
                f"partition {spec.partition!r} is unknown to this cluster (sinfo lists: "
                f"{', '.join(known) or 'none'}); set --partition or launch.slurm.partition"
            )
    job_id = read_job_id(spec.run_dir)
    if job_id and job_state(job_id).get("JobState") in ACTIVE_STATES:
        raise SlurmError(
            f"{spec.run_dir} already has job {job_id} queued or running; wait for it, "
            f"`rl3d slurm cancel {spec.run_dir}`, or set trainer.run_dir"
        )


def submit(recipe: str, overrides: list[str], args: argparse.Namespace, *, entry=None) -> int:
    """Validate, write the scripts, and (unless --dry-run) submit. `entry` replaces the trainer
    module in the job (tests use it to run a probe through the same scripts)."""
    sub = write_job(recipe, overrides, args, entry=entry)
    if args.dry_run:
        _echo(f"# {sub.batch_script}\n{sub.batch_script.read_text()}")
        if sub.node_script:
            _echo(f"# {sub.node_script}\n{sub.node_script.read_text()}")
        _echo(f"# dry run: written, not submitted. Submit with: sbatch {sub.batch_script}")
        return 0
    proc = _run(["sbatch", "--parsable", str(sub.batch_script)])
    if proc.returncode != 0:
        _echo(f"rl3d slurm: sbatch rejected the job: {proc.stderr.strip()}", err=True)
        return 1
    job_id = proc.stdout.strip().split(";")[0]
    (sub.spec.slurm_dir / JOB_ID_NAME).write_text(job_id + "\n")
    _echo(f"submitted job {job_id}: {sub.spec.nodes} node(s) x {sub.spec.nproc_per_node} ranks")
    _echo(f"run dir  {sub.spec.run_dir}\nlogs     {sub.spec.log_dir}")
    _echo(f"status   rl3d slurm status {sub.spec.run_dir}")
    return 0


def write_job(recipe: str, overrides: list[str], args: argparse.Namespace, *, entry=None) -> Submission:
    loaded, spec = _job_spec(recipe, overrides, args)
    if entry is not None:
        spec = dataclasses.replace(spec, entry=tuple(entry))
    for line in missing_inputs(loaded.config):
        _echo(f"rl3d slurm: warning: {line} does not exist here; the job checks again on its nodes", err=True)
    preflight(loaded, absent_ok=True)  # what exists here is checked now, the rest on the nodes
    if not args.dry_run:
        _check_cluster(spec)  # refuses a run dir whose job is still queued or running
        if getattr(args, "overwrite", False) and spec.run_dir.is_dir():
            removed = clear_run_dir(spec.run_dir)
            if removed:
                _echo(f"overwrite: removed {', '.join(removed)} of the earlier run")
    spec.log_dir.mkdir(parents=True, exist_ok=True)
    write_resolved_config(loaded, spec.slurm_dir)
    batch = spec.slurm_dir / BATCH_NAME
    batch.write_text(render_batch_script(spec))
    batch.chmod(0o755)
    node = None
    if spec.backend == "spmd":
        node = spec.slurm_dir / NODE_NAME
        node.write_text(render_node_script(spec))
        node.chmod(0o755)
    return Submission(spec, batch, node)


# -- status and cancel ------------------------------------------------------------------------
def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        raise SlurmError(f"{cmd[0]} is not on the PATH (is this a SLURM login node?)") from None


def read_job_id(run_dir: str | os.PathLike) -> str | None:
    path = Path(run_dir) / SLURM_SUBDIR / JOB_ID_NAME
    return (path.read_text().strip() or None) if path.is_file() else None


def job_state(job_id: str) -> dict[str, str]:
    """What SLURM knows of the job: `scontrol show job`, else `sacct`; {} when neither does."""
    if shutil.which("scontrol") is None:
        return {}
    proc = _run(["scontrol", "show", "job", "-o", job_id])
    if proc.returncode == 0 and proc.stdout.strip():
        fields: dict[str, str] = {}
        for token in proc.stdout.split():
            key, sep, value = token.partition("=")
            if sep:
                fields.setdefault(key, value)
        return fields
    if shutil.which("sacct"):
        acct = _run(["sacct", "-j", job_id, "-X", "-n", "-P", "-o", "State,ExitCode,NodeList"])
        line = acct.stdout.strip().splitlines()[:1] if acct.returncode == 0 else []
        if line and line[0].count("|") == 2:
            state, exit_code, nodes = line[0].split("|")
            return {"JobState": state.split()[0], "ExitCode": exit_code, "NodeList": nodes}
    return {}


def _last_history(run_dir: Path) -> str | None:
    path = run_dir / SLURM_SUBDIR / HISTORY_NAME
    lines = path.read_text().splitlines() if path.is_file() else []
    return lines[-1] if lines else None


def _require_job(run_dir: str) -> tuple[Path, str]:
    path = Path(run_dir).resolve()
    job_id = read_job_id(path)
    if job_id is None:
        raise SlurmError(f"no SLURM job recorded in {path} (expected {path / SLURM_SUBDIR / JOB_ID_NAME})")
    return path, job_id


def slurm_status(run_dir: str) -> int:
    path, job_id = _require_job(run_dir)
    fields = job_state(job_id)
    state = fields.get("JobState", "UNKNOWN")
    _echo(f"run dir  {path}")
    _echo(f"job      {job_id}  {state}" + (f"  exit {fields['ExitCode']}" if "ExitCode" in fields else ""))
    if fields.get("Reason") not in (None, "None"):
        _echo(f"reason   {fields['Reason']}")
    if fields.get("Restarts") not in (None, "0"):
        _echo(f"restarts {fields['Restarts']}")
    if fields.get("NodeList") not in (None, "(null)", ""):
        _echo(f"nodes    {fields['NodeList']}")
    last = _last_history(path)
    if last:
        _echo(f"last     {last}")
    if not fields:
        _echo("slurm    no longer knows this job (past MinJobAge, no accounting); see `last` above")
    logs = sorted((path / SLURM_SUBDIR / "logs").glob(f"job{job_id}-*.log"), key=lambda p: p.stat().st_mtime)
    if logs:
        _echo(f"logs     {logs[-1].parent}")
    if state not in ACTIVE_STATES | {"COMPLETED", "UNKNOWN"}:
        for log in [p for p in logs if "-node" in p.name][-2:]:
            tail = log.read_text(errors="replace").splitlines()[-15:]
            _echo(f"--- {log.name} (last {len(tail)} lines)")
            _echo("\n".join(tail))
    return 0


def slurm_cancel(run_dir: str) -> int:
    path, job_id = _require_job(run_dir)
    if shutil.which("scancel") is None:
        raise SlurmError("scancel is not on the PATH (is this a SLURM login node?)")
    state = job_state(job_id).get("JobState", "UNKNOWN")
    if state not in ACTIVE_STATES:
        _echo(f"job {job_id} is not queued or running ({state}); nothing to cancel")
        return 0
    proc = _run(["scancel", job_id])
    if proc.returncode != 0:
        _echo(f"rl3d slurm: scancel {job_id} failed: {proc.stderr.strip()}", err=True)
        return 1
    _echo(f"cancelled job {job_id} ({path})")
    return 0
