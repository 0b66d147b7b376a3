"""Shared by the sandbox tests: a run made by a trainer that is not root."""

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

UNPRIVILEGED_RUN = """
import json, sys
sys.path.insert(0, sys.argv[1])
from rl3d.tools.python_sandbox import SandboxConfig, isolation_problem, run_python, to_result
config = SandboxConfig(**json.loads(sys.argv[3]))
problem = isolation_problem(config)
try:
    result = None if problem else to_result(run_python(sys.argv[2], config), config).__dict__
except RuntimeError as err:
    result = {"raised": str(err)}
print(json.dumps({"problem": problem, "result": result}))
"""


@pytest.fixture
def as_unprivileged_trainer():
    """`run(code, **options)`: the code's result when a trainer of uid nobody runs it (through a
    user namespace) with these sandbox options (`wall_seconds` 20 unless given)."""

    def run(code: str, **options) -> dict:
        python = shutil.which("python3", path="/usr/bin:/bin")
        src = Path(__file__).resolve().parents[3] / "src"
        if os.geteuid() != 0 or not shutil.which("setpriv") or python is None:
            pytest.skip("needs root, setpriv and a system python3 to run as uid nobody")
        drop = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
        settings = json.dumps({"wall_seconds": 20, **options})
        proc = subprocess.run(
            [*drop, python, "-c", UNPRIVILEGED_RUN, str(src), code, settings],
            env={"PATH": "/usr/bin:/bin"}, cwd="/", capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        if proc.returncode != 0:
            pytest.skip(f"the source tree cannot be imported as uid nobody here: {proc.stderr[-300:]}")
        report = json.loads(proc.stdout.splitlines()[-1])
        if report["problem"]:
            pytest.skip(f"no unprivileged user namespaces here: {report['problem']}")
        return report["result"]

    return run
