"""benchmarks/device_check.py, the prepared GPU check, on a CPU: its dry run writes a report in
which every stage is skipped with a reason; the budget table in its header is its STAGES table
and each set fits its cap; the runner records each stage as it ends, kills a stage's whole
process group at its budget and skips what no longer fits; the commands it would run take
configs that validate here."""

import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "benchmarks" / "device_check.py"
ROW = re.compile(r"^\| (first|rest|multi) \| (\d+|-) \| ([\w-]+) \| (\d+) \| (.+?) \|$", re.M)


@pytest.fixture(scope="module")
def dc():
    spec = importlib.util.spec_from_file_location("device_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    path = list(sys.path)  # the script puts its own folder first
    sys.modules["device_check"] = module  # its dataclass looks itself up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules["device_check"]
    sys.path[:] = path


def run_driver(out: Path, *args: str) -> dict:
    paths = [str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = os.environ | {"PYTHONPATH": os.pathsep.join(paths)}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out), "--work", str(out / "work"), *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(p.name for p in out.iterdir() if p.is_file()) == ["device_check.log", "report.json"]
    return json.loads((out / "report.json").read_text())


def test_dry_run_skips_every_stage_with_its_reason_and_writes_the_report(dc, tmp_path):
    report = run_driver(tmp_path, "--stages", "all", "--dry-run")
    assert report["format"] == dc.FORMAT and report["dry_run"] and report["finished"]
    assert [s["name"] for s in report["stages"]] == [s.name for s in dc.STAGES]
    for entry, stage in zip(report["stages"], dc.STAGES):
        assert entry["status"] == "skipped" and entry["reason"] == "dry run (--dry-run)", entry
        assert (entry["set"], entry["budget_s"], entry["what"]) == (stage.set, stage.budget_s, stage.what)
        assert entry["commands"] and entry["seconds"] is None and entry["metrics"] == {}
    assert report["summary"]["skipped"] == len(dc.STAGES) == sum(report["summary"].values())
    for name, budget in report["budget_s"].items():
        stages = sum(s["budget_s"] for s in report["stages"] if s["set"] == name)
        assert budget["total"] == budget["install"] + budget["start_up"] + stages <= budget["cap"], name
    assert report["budget_s"]["first"]["cap"] == 8 * 60  # one lent H100, install included
    assert max(b["cap"] for b in report["budget_s"].values()) <= 600  # one device command at most
    multi = [s for s in report["stages"] if s["set"] == "multi"]
    assert "torch.distributed.run" in multi[0]["commands"][0]
    assert "recipes/gpu_llama2_7b_ppo.yaml" in multi[-1]["commands"][0]
    assert multi[-1]["needs"] == {"gpus": 8, "modules": ["sglang", "transformer_engine"],
                                  "env": ["RL3D_LLAMA2_7B_HF", "RL3D_GSM8K_TRAIN"]}  # fmt: skip


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the driver would run the stages")
def test_without_cuda_the_run_is_a_dry_run(tmp_path):
    report = run_driver(tmp_path)
    assert report["sets"] == ["first"] and report["machine"]["cuda_available"] is False
    assert report["dry_run_reason"] == "dry run: no CUDA device here (torch.cuda.is_available() is False)"
    assert {s["status"] for s in report["stages"]} == {"skipped"}
    assert all(s["reason"] == report["dry_run_reason"] for s in report["stages"])


def test_the_header_budget_table_is_the_stages_table(dc):
    rows = ROW.findall(dc.__doc__)
    named = [(set_, int(n), name, int(b), what) for set_, n, name, b, what in rows if n != "-"]
    stages = {s: [x for x in dc.STAGES if x.set == s] for s in dc.SETS}
    assert named == [
        (s.set, i, s.name, s.budget_s, s.what)
        for set_ in dc.SETS
        for i, s in enumerate(stages[set_], start=1)
    ]
    for set_ in dc.SETS:
        extra = {name: (int(b), what) for s, n, name, b, what in rows if s == set_ and n == "-"}
        assert extra["install"][0] == dc.INSTALL_S and extra["start-up"][0] == dc.START_UP_S
        assert extra["total"] == (dc.set_total_s(set_), f"cap {dc.CAP_S[set_]}")
        assert dc.set_total_s(set_) <= dc.CAP_S[set_]


def test_skip_reasons(dc, monkeypatch):
    one_h100 = {"cuda_available": True, "gpus": 1, "gib": 79.2}
    by_name = {s.name: s for s in dc.STAGES}
    assert dc.skip_reason(by_name["batched_p2p_nccl"], one_h100) == "needs 2 GPUs, this machine has 1"
    assert dc.skip_reason(by_name["memory_plan_7b"], one_h100) == (
        "needs 110 GiB of GPU memory, this GPU has 79.2"
    )
    eight = {"cuda_available": True, "gpus": 8, "gib": 79.2}
    monkeypatch.setattr(dc.importlib.util, "find_spec", lambda name: object())
    monkeypatch.delenv("RL3D_LLAMA2_7B_HF", raising=False)
    monkeypatch.setenv("RL3D_GSM8K_TRAIN", "/data/train.parquet")
    assert dc.skip_reason(by_name["ppo_7b"], eight) == "needs $RL3D_LLAMA2_7B_HF (see benchmarks/README.md)"
    monkeypatch.setattr(dc.importlib.util, "find_spec", lambda name: None)
    assert "sglang, transformer_engine" in dc.skip_reason(by_name["ppo_7b"], eight)
    assert dc.skip_reason(by_name["kernels_cuda"], one_h100) is None
    with pytest.raises(SystemExit, match="unknown stages or sets"):
        dc.stages_of("first,kernal")
    in_order = ["kernels_cuda", "offload"]  # priority order, whatever order they are named in
    assert [s.name for s in dc.stages_of("offload,kernels_cuda")] == in_order


def test_the_runner_records_each_stage_and_time_boxes_it(dc, tmp_path, monkeypatch):
    """Stages in priority order: one passes and leaves a JSON, one fails, one hangs with a child of
    its own and is killed with its whole group when the cap's time runs out, and the last no
    longer fits. The report is rewritten as each stage starts and ends."""
    marker = tmp_path / "grandchild.pid"
    stages = (
        dc.Stage("ok", "first", 20, "passes",
                 ("""{py} -c 'import json; json.dump(dict(x=1), open("{work}/m.json", "w"))'""",),
                 (("m", "m.json"),)),
        dc.Stage("fails", "first", 20, "exits 3", ("{py} -c 'raise SystemExit(3)'",)),
        dc.Stage("hangs", "first", 600, "sleeps until killed",
                 (f"bash -c 'sleep 60 & echo $! > {marker}; wait'",)),
        dc.Stage("late", "first", 20, "no time left", ("{py} -c pass",)),
    )  # fmt: skip
    monkeypatch.setattr(dc, "STAGES", stages)
    monkeypatch.setattr(dc, "MIN_STAGE_S", 1)
    monkeypatch.setattr(dc, "probe_machine", lambda: {"cuda_available": True, "gpus": 1, "gib": 80.0})
    seen = []
    real_write = dc.Report.write

    def write(self):
        real_write(self)
        seen.append([s["status"] for s in json.loads(self.path.read_text())["stages"]])

    monkeypatch.setattr(dc.Report, "write", write)
    out, cap_s = tmp_path / "out", dc.FINISH_S + 10
    rc = dc.main(["--out", str(out), "--work", str(tmp_path / "work"), "--cap-s", str(cap_s)])
    assert rc == 1
    report = json.loads((out / "report.json").read_text())
    got = {s["name"]: s for s in report["stages"]}
    assert got["ok"]["status"] == "passed" and got["ok"]["metrics"] == {"m": {"x": 1}}
    assert got["fails"]["status"] == "failed" and got["fails"]["reason"].startswith("exit 3")
    assert got["fails"]["log_tail"][0].startswith("$ ")
    assert got["hangs"]["status"] == "timed_out" and "of its 600 s budget" in got["hangs"]["reason"]
    assert got["hangs"]["seconds"] < 10 + dc.KILL_GRACE_S + 2
    assert got["late"]["status"] == "skipped" and got["late"]["reason"].startswith("no time left")
    assert seen[0] == ["pending"] * 4 and ["passed", "running", "pending", "pending"] in seen
    assert seen[-1] == ["passed", "failed", "timed_out", "skipped"] and report["finished"]
    grandchild = int(marker.read_text())
    deadline = time.monotonic() + 5
    while running(grandchild) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not running(grandchild)  # killed with its group, not left running


def running(pid: int) -> bool:
    """Whether process `pid` still runs: gone, or a zombie (killed, its exit not yet collected by
    the init process that adopted it, which may take its time), is not running."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_metrics_from_junit_and_a_runs_metrics_jsonl(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from device_metrics import collect
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    (tmp_path / "junit.xml").write_text(
        '<testsuites><testsuite tests="3" failures="1" errors="0" skipped="1">'
        '<testcase classname="t" name="a"/>'
        '<testcase classname="t" name="b"><failure message="boom"/></testcase>'
        '<testcase classname="t" name="c"><skipped message="needs TE"/></testcase></testsuite></testsuites>'
    )
    (tmp_path / "run").mkdir()
    steps = [
        {"time/step": 9.0, "perf/tokens_per_s": 10.0, "rollout/logp_diff_max": 0.5,
         "rollout/logp_diff_mean": 0.1, "reward/score_mean": 0.0},
        {"time/step": 2.0, "perf/tokens_per_s": 100.0, "rollout/logp_diff_max": 0.25,
         "rollout/logp_diff_mean": 0.3, "reward/score_mean": 0.5},
        {"time/step": 4.0, "perf/tokens_per_s": 50.0},
    ]  # fmt: skip
    (tmp_path / "run" / "metrics.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    (tmp_path / "bad.json").write_text("{")
    got = collect(tmp_path, (("pytest", "junit.xml"), ("run", "run/metrics.jsonl"), ("bad", "bad.json"),
                             ("absent", "nothing.json")))  # fmt: skip
    assert got["pytest"]["tests"] == 3 and got["pytest"]["failures"] == 1
    assert got["pytest"]["failed"] == [{"test": "t::b", "message": "boom"}]
    assert got["pytest"]["skipped_tests"] == [{"test": "t::c", "message": "needs TE"}]
    run = got["run"]
    assert run["steps"] == 3 and run["median time/step"] == 3.0 and run["median perf/tokens_per_s"] == 75.0
    assert run["rollout/logp_diff_max (max over steps)"] == 0.5
    assert run["rollout/logp_diff_mean (mean over steps)"] == pytest.approx(0.2)
    assert run["reward/score_mean first, last"] == [0.0, 0.5]
    assert "unreadable" in got["bad"] and "absent" not in got


def test_the_training_commands_take_configs_that_validate(dc, tmp_path, capsys):
    """The GRPO stage's overrides (a stand-in model directory) and the 7B PPO stage's (a llama2-7b
    config without weights) pass `rl3d validate`, as the runs would start with them."""
    from rl3d.cli import main
    from rl3d.data.gsm8k_synth import write_splits
    from rl3d.models.hf_mapping import hf_config_from_spec
    from rl3d.models.spec import get_model_spec

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from grpo_smollm2_gpu import RECIPE, train_overrides
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    data = tmp_path / "data"
    write_splits(data, num_train=8, num_val=4, seed=0, steps=1, max_number=5, ops=("add",), system=None,
                 instruction="")  # fmt: skip
    for name in ("tiny-llama", "llama2-7b"):
        hf_config_from_spec(get_model_spec(name)).save_pretrained(tmp_path / name)
    grpo = train_overrides(
        tmp_path / "tiny-llama", data, tmp_path / "run", steps=5, device="cuda", dtype="bfloat16"
    )
    assert main(["validate", str(ROOT / RECIPE), *grpo]) == 0
    ppo = next(s for s in dc.STAGES if s.name == "ppo_7b")
    (line,) = dc.command_lines(ppo, tmp_path / "ppo", nproc=8)
    overrides = line[line.index("recipes/gpu_llama2_7b_ppo.yaml") + 1 :]
    overrides = [
        f"model.hf_path={tmp_path / 'llama2-7b'}" if w.startswith("model.hf_path=")
        else f"data.train_files=[{data / 'train.parquet'}]" if w.startswith("data.train_files=") else w
        for w in overrides
    ]  # fmt: skip
    assert main(["validate", str(ROOT / "recipes/gpu_llama2_7b_ppo.yaml"), *overrides]) == 0
    assert "gpu_llama2_7b_ppo.yaml: valid" in capsys.readouterr().out
