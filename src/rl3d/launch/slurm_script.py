"""The scripts `rl3d slurm` writes into a run directory: `slurm/job.sbatch` and `slurm/node.sh`.

SPMD backend: the batch script resolves the master node, then one `srun` step starts `node.sh`
once per node; each runs a preflight check and one `torchrun` (c10d rendezvous at the master)
for all of that node's ranks (`-m rl3d.train`). Ray backend: the batch script starts a Ray head
on the first node and workers on the others (with a token of the job's own), waits until all
joined, runs the driver (`rl3d train`, which joins $RAY_ADDRESS) on the first node, and stops
the cluster. Per-node logs go to `RUN_DIR/slurm/logs/job<ID>-r<restart>-node<N>.log`.

Preemption contract (`#SBATCH --signal=B:USR1@<lead>`): SLURM sends USR1 to the batch shell
`lead` seconds before the time limit (or `scancel --batch --signal=USR1 JOB` does). The batch
shell passes USR1 to the step; torchrun ignores it (its default action would kill it), and
`node.sh` passes it to torchrun's children, the ranks. A rank may see it more than once. The
trainer is expected to agree across ranks to stop at a step boundary, save a checkpoint and exit
0. Then the batch shell runs `scontrol requeue`, and the restarted job resumes from the newest
checkpoint in the run directory (`checkpoint.resume: auto`). If the ranks are still running
`grace` seconds after USR1, the step is terminated and the job is requeued all the same. With
the Ray backend the batch shell sends USR1 to the driver (the controller) itself.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

SLURM_SUBDIR = "slurm"
BATCH_NAME = "job.sbatch"
NODE_NAME = "node.sh"
RESOLVED_NAME = "resolved_config.yaml"
JOB_ID_NAME = "job_id"
HISTORY_NAME = "history.log"
TRAIN_ENTRY = ("-m", "rl3d.train")  # what each torchrun worker runs (SPMD)
RAY_DRIVER_ENTRY = ("-m", "rl3d.cli", "train")  # `rl3d train` is the Ray driver (ray_launch)


@dataclass(frozen=True, kw_only=True)
class JobSpec:
    """Everything a generated job needs; every path absolute."""

    run_dir: Path
    recipe: str  # what the user submitted; for the header only, the job runs the resolved copy
    job_name: str
    nodes: int
    nproc_per_node: int  # ranks (torchrun workers) per node
    gpus_per_node: int  # 0 = CPU job
    backend: Literal["spmd", "ray"] = "spmd"
    workdir: Path
    python: str
    partition: str | None = None
    account: str | None = None
    time: str | None = None
    requeue: bool = True
    signal_lead_s: int = 120
    modules: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    container_image: str | None = None
    container_mounts: tuple[str, ...] = ()
    sbatch_args: tuple[str, ...] = ()  # extra `#SBATCH` options, e.g. --exclusive
    entry: tuple[str, ...] | None = None  # what runs the recipe; None = TRAIN_ENTRY / RAY_DRIVER_ENTRY
    ray_join_timeout_s: int = 300

    def __post_init__(self) -> None:
        assert self.nodes >= 1 and self.nproc_per_node >= 1 and self.gpus_per_node >= 0
        assert self.run_dir.is_absolute() and self.workdir.is_absolute()
        for key in self.env:
            if not key.replace("_", "a").isalnum() or key[0].isdigit():
                raise ValueError(f"launch.slurm.env: {key!r} is not a valid environment variable name")

    @property
    def slurm_dir(self) -> Path:
        return self.run_dir / SLURM_SUBDIR

    @property
    def resolved_config(self) -> Path:
        return self.slurm_dir / RESOLVED_NAME

    @property
    def log_dir(self) -> Path:
        return self.slurm_dir / "logs"

    @property
    def entry_args(self) -> tuple[str, ...]:
        if self.entry is not None:
            return self.entry
        return RAY_DRIVER_ENTRY if self.backend == "ray" else TRAIN_ENTRY

    @property
    def grace_s(self) -> int:
        """How long the ranks get to checkpoint after USR1, leaving time to requeue."""
        return max(10, self.signal_lead_s - 20)

    @property
    def device(self) -> str:
        return "cuda" if self.gpus_per_node else "cpu"


def _q(value: object) -> str:
    return shlex.quote(str(value))


def _sbatch_header(spec: JobSpec) -> list[str]:
    opts = [
        f"--job-name={spec.job_name}",
        f"--nodes={spec.nodes}",
        "--ntasks-per-node=1",  # one torchrun (or Ray node) per node; it starts the ranks
    ]
    if spec.gpus_per_node:
        opts.append(f"--gpus-per-node={spec.gpus_per_node}")
    else:
        opts.append(f"--cpus-per-task={spec.nproc_per_node}")
    for name in ("partition", "account", "time"):
        if getattr(spec, name):
            opts.append(f"--{name}={getattr(spec, name)}")
    opts += [
        f"--chdir={spec.workdir}",
        f"--output={spec.log_dir}/job%j-batch.log",
        "--open-mode=append",  # a requeued job appends to its logs
        "--requeue" if spec.requeue else "--no-requeue",
        f"--signal=B:USR1@{spec.signal_lead_s}",
        *spec.sbatch_args,
    ]
    return [f"#SBATCH {opt}" for opt in opts]


def _site_setup(spec: JobSpec) -> list[str]:
    lines = []
    if spec.modules:
        lines += [
            "# site modules (`module` comes from the login profile when the batch shell lacks it)",
            "command -v module >/dev/null 2>&1 || source /etc/profile >/dev/null 2>&1 || true",
            *(f"module load {_q(m)}" for m in spec.modules),
        ]
    lines += [f"export {key}={_q(value)}" for key, value in spec.env.items()]
    return lines


def _container_flags(spec: JobSpec) -> str:
    """pyxis/enroot flags for srun; the run directory is always mounted."""
    if not spec.container_image:
        return ""
    mounts = [*spec.container_mounts, f"{spec.run_dir}:{spec.run_dir}"]
    return f" --container-image={_q(spec.container_image)} --container-mounts={_q(','.join(mounts))}"


_PRELUDE = r"""set -uo pipefail

RUN_DIR={run_dir}
SLURM_DIR="$RUN_DIR/slurm"
LOG_DIR="$SLURM_DIR/logs"
PYTHON={python}
RESTART="${{SLURM_RESTART_COUNT:-0}}"
mkdir -p "$LOG_DIR"
note() {{
  printf '%s job=%s restart=%s %s\n' "$(date -u +%FT%TZ)" "$SLURM_JOB_ID" "$RESTART" "$*" \
    >>"$SLURM_DIR/{history}"
}}
echo "$SLURM_JOB_ID" >"$SLURM_DIR/{job_id}"
export PYTHONUNBUFFERED=1
# The same code whatever the working directory (rl3d.launch.torchrun_job.launch_env)
export PYTHONSAFEPATH=1 RL3D_LAUNCH_DIR="${{RL3D_LAUNCH_DIR:-$SLURM_SUBMIT_DIR}}"
"""

# USR1 -> the running step; after `grace` seconds the step is ended so the job can requeue.
_PREEMPT = r"""PREEMPTED=0
STEP_PID=""
WATCHDOG_PID=""
on_usr1() {{
  PREEMPTED=1
  note "USR1: asking the ranks to checkpoint and exit (grace {grace}s)"
  [ -n "$STEP_PID" ] && kill -USR1 "$STEP_PID" 2>/dev/null
  if [ -z "$WATCHDOG_PID" ] && [ -n "$STEP_PID" ]; then
    ( sleep {grace}; note "grace over: ending the step"; kill -TERM "$STEP_PID" 2>/dev/null ) &
    WATCHDOG_PID=$!
  fi
}}
trap on_usr1 USR1

# `wait` returns early when a trapped signal arrives: wait again until the step has really ended.
wait_step() {{
  local rc
  while :; do
    wait "$STEP_PID"; rc=$?
    kill -0 "$STEP_PID" 2>/dev/null || return "$rc"
  done
}}

finish() {{
  local rc=$1
  [ -n "$WATCHDOG_PID" ] && kill "$WATCHDOG_PID" 2>/dev/null
  if [ "$PREEMPTED" = 1 ]; then
    {on_preempt}
  fi
  note "end rc=$rc"
  exit "$rc"
}}
"""

_REQUEUE = r"""note "step ended (rc=$rc) after USR1: requeue"
    if scontrol requeue "$SLURM_JOB_ID"; then exit 0; fi
    note "scontrol requeue failed"
"""
_NO_REQUEUE = 'note "step ended (rc=$rc) after USR1; requeue is off"'


def render_batch_script(spec: JobSpec) -> str:
    """The sbatch script for `spec` (SPMD: srun + torchrun; Ray: a Ray cluster and its driver)."""
    header = [
        "#!/bin/bash",
        f"# Written by `rl3d slurm` for {spec.recipe}; the job runs the resolved copy",
        f"# {spec.resolved_config}. Resubmit as is with: sbatch {spec.slurm_dir / BATCH_NAME}",
        *_sbatch_header(spec),
        "",
    ]
    prelude = _PRELUDE.format(
        run_dir=_q(spec.run_dir), python=_q(spec.python), history=HISTORY_NAME, job_id=JOB_ID_NAME
    )
    on_preempt = (_REQUEUE if spec.requeue else _NO_REQUEUE).strip()
    preempt = _PREEMPT.format(grace=spec.grace_s, on_preempt=on_preempt)
    body = _ray_body(spec) if spec.backend == "ray" else _spmd_body(spec)
    parts = ["\n".join(header), prelude, "\n".join(_site_setup(spec)), preempt, body]
    return "\n".join(part for part in parts if part) + "\n"


def _spmd_body(spec: JobSpec) -> str:
    return f"""MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
# a port per job (and per restart) so that two jobs sharing a node do not collide
MASTER_PORT=$((20000 + (SLURM_JOB_ID * 8 + RESTART) % 40000))
export MASTER_ADDR MASTER_PORT
note "start nodes=$SLURM_JOB_NODELIST master=$MASTER_ADDR:$MASTER_PORT"

srun --nodes={spec.nodes} --ntasks-per-node=1 --kill-on-bad-exit=1 \\
  --output="$LOG_DIR/job$SLURM_JOB_ID-r$RESTART-node%n.log"{_container_flags(spec)} \\
  bash "$SLURM_DIR/{NODE_NAME}" &
STEP_PID=$!
wait_step
finish $?
"""


def render_node_script(spec: JobSpec) -> str:
    """One node's share of an SPMD job: preflight, then one torchrun for all its ranks."""
    entry = " ".join(_q(a) for a in spec.entry_args)
    return f"""#!/bin/bash
# Started by `srun` from {BATCH_NAME}, once per node: a preflight check, then one torchrun for
# this node's {spec.nproc_per_node} ranks, which meet at $MASTER_ADDR:$MASTER_PORT (c10d rendezvous).
set -uo pipefail
PYTHON={_q(spec.python)}
RESOLVED={_q(spec.resolved_config)}
echo "rl3d node $SLURM_NODEID/$SLURM_NNODES on $(hostname):" \\
  "job $SLURM_JOB_ID, restart ${{SLURM_RESTART_COUNT:-0}}"

"$PYTHON" -m rl3d.launch.slurm_job preflight "$RESOLVED" \\
  --nproc-per-node={spec.nproc_per_node} --device={spec.device} || exit $?

# USR1 is for the ranks: torchrun ignores it (inherited by the ranks until they install their
# handler), and this shell passes it to torchrun's children.
TORCHRUN_PID=""
trap '[ -n "$TORCHRUN_PID" ] && pkill -USR1 -P "$TORCHRUN_PID"' USR1
(
  trap '' USR1
  exec "$PYTHON" -m rl3d.launch.torchrun \\
    --nnodes="$SLURM_NNODES" --nproc-per-node={spec.nproc_per_node} --max-restarts=0 \\
    --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="$SLURM_JOB_ID" \\
    {entry} "$RESOLVED"
) &
TORCHRUN_PID=$!
while :; do
  wait "$TORCHRUN_PID"; rc=$?
  kill -0 "$TORCHRUN_PID" 2>/dev/null || exit "$rc"
done
"""


def _ray_body(spec: JobSpec) -> str:
    ray = "ray" if "/" not in spec.python else _q(str(Path(spec.python).with_name("ray")))
    resources = f"--num-gpus={spec.gpus_per_node}" if spec.gpus_per_node else "--num-gpus=0"
    container = _container_flags(spec)
    entry = " ".join(_q(a) for a in spec.entry_args)
    workers = ""
    if spec.nodes > 1:
        workers = f"""srun --overlap --nodes={spec.nodes - 1} --ntasks={spec.nodes - 1} --ntasks-per-node=1 \\
  --exclude="$HEAD_NODE" --output="$LOG_DIR/job$SLURM_JOB_ID-r$RESTART-node%n.log"{container} \\
  {ray} start --address="$RAY_ADDRESS" {resources} --block &
RAY_PIDS="$RAY_PIDS $!"
"""
    return f"""HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
HEAD_IP=$(srun --overlap --nodes=1 --ntasks=1 -w "$HEAD_NODE" hostname --ip-address | awk '{{print $1}}')
RAY_PORT=$((20000 + (SLURM_JOB_ID * 8 + RESTART) % 40000))
export RAY_ADDRESS="$HEAD_IP:$RAY_PORT"  # ray.init() joins this cluster
# The job's own Ray token: its cluster is closed to others, and does not depend on the
# ~/.ray/auth_token that every other Ray cluster of this user on these nodes shares.
export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH="$SLURM_DIR/ray_auth_token"
( umask 077; "$PYTHON" -c 'import secrets; print(secrets.token_hex(32))' >"$RAY_AUTH_TOKEN_PATH" )
note "start nodes=$SLURM_JOB_NODELIST ray head=$RAY_ADDRESS"

srun --overlap --nodes={spec.nodes} --ntasks-per-node=1 \\
  --output="$LOG_DIR/job$SLURM_JOB_ID-r$RESTART-preflight-node%n.log"{container} \\
  "$PYTHON" -m rl3d.launch.slurm_job preflight "$SLURM_DIR/{RESOLVED_NAME}" \\
  --nproc-per-node={spec.nproc_per_node} --device={spec.device} || finish $?

stop_ray() {{
  srun --overlap --nodes={spec.nodes} --ntasks-per-node=1{container} \\
    --output="$LOG_DIR/job$SLURM_JOB_ID-r$RESTART-ray-stop-node%n.log" {ray} stop
  for pid in $RAY_PIDS; do kill -TERM "$pid" 2>/dev/null; done
  wait $RAY_PIDS 2>/dev/null
  note "ray cluster stopped"
}}
RAY_PIDS=""
srun --overlap --nodes=1 --ntasks=1 -w "$HEAD_NODE" \\
  --output="$LOG_DIR/job$SLURM_JOB_ID-r$RESTART-node0.log"{container} \\
  {ray} start --head --node-ip-address="$HEAD_IP" --port="$RAY_PORT" {resources} --block &
RAY_PIDS="$!"
{workers}
if ! "$PYTHON" -m rl3d.launch.slurm_job wait-ray --nodes={spec.nodes} \\
    --timeout={spec.ray_join_timeout_s} --watch-pid="${{RAY_PIDS%% *}}"; then
  stop_ray
  finish 1
fi

"$PYTHON" {entry} "$SLURM_DIR/{RESOLVED_NAME}" >>"$LOG_DIR/job$SLURM_JOB_ID-r$RESTART-driver.log" 2>&1 &
STEP_PID=$!
wait_step
rc=$?
stop_ray
finish "$rc"
"""
