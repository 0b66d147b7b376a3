"""The preflight runs each tool's own check: a Python tool whose isolation this machine cannot
give is refused with one line naming the key and what is missing."""

from pathlib import Path

import pytest

import rl3d.tools.python_sandbox as python_sandbox
from rl3d.cli import EXIT_BAD_INPUT, main
from rl3d.tools.python_sandbox import SandboxConfig, isolation_problem

RECIPE = str(Path(__file__).resolve().parents[3] / "recipes/quickstart_cpu_tool_grpo.yaml")
PYTHON_TOOL = "rollout.agent.tools={python: {cpu_seconds: 2}}"


def validate(capsys, *overrides: str) -> tuple[int, str]:
    code = main(["validate", "--preflight", RECIPE, *overrides])
    return code, capsys.readouterr().err


@pytest.mark.skipif(
    isolation_problem(SandboxConfig()) is not None, reason="kernel isolation unavailable here"
)
def test_python_tool_with_working_isolation_passes(capsys):
    code, err = validate(capsys, PYTHON_TOOL)
    assert code == 0, err


def test_python_tool_refused_naming_what_is_missing(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(python_sandbox, "_PROBED", {})  # probe again, on this machine minus `unshare`
    monkeypatch.setenv("PATH", str(tmp_path))
    code, err = validate(capsys, PYTHON_TOOL)
    assert code == EXIT_BAD_INPUT
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "rollout.agent.tools.python.isolation" in lines[0], err
    assert "`unshare` (util-linux) is not installed" in lines[0]


def test_weaker_isolation_is_a_setting_and_is_logged(capsys, caplog):
    override = "rollout.agent.tools={python: {isolation: process}}"
    with caplog.at_level("WARNING", logger="rl3d.tools.sandbox_setup"):
        code, err = validate(capsys, override)
    assert code == 0, err
    assert "tools.python.isolation is 'process'" in caplog.text
