"""The locks in constraints/ agree with setup.py: every requirement of the CPU install ([dev]) and
of the GPU install ([gpu,dev] on CPython 3.12) is pinned there, at a version its range admits. A
range changed without `make lock` (or `make lock-gpu`) fails here, before an install does."""

import importlib.util
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]


def lock_tool():
    spec = importlib.util.spec_from_file_location("rl3d_lock", ROOT / ".ci" / "rl3d_lock.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def unmet(lock: Path, extras: list[str], environment: dict[str, str]) -> list[str]:
    tool = lock_tool()
    pins = tool.read(lock)
    problems = []
    for line in tool.setup_requirements(extras):
        req = Requirement(line)
        if req.marker and not req.marker.evaluate(environment):
            continue
        version = pins.get(tool.canonical(req.name))
        if version is None:
            problems.append(f"{req.name}: not in {lock.name}")
        elif not req.specifier.contains(version, prereleases=True):
            problems.append(f"{req.name}=={version} in {lock.name} is outside setup.py's {req}")
    return problems


LINUX = {"platform_system": "Linux", "platform_machine": "x86_64"}


@pytest.mark.parametrize(
    "lock, extras, python", [("cpu-py311.txt", ["dev"], "3.11"), ("gpu-py312.txt", ["gpu", "dev"], "3.12")]
)
def test_the_lock_pins_every_requirement_inside_its_range(lock, extras, python):
    assert unmet(ROOT / "constraints" / lock, extras, {**LINUX, "python_version": python}) == []


def test_a_range_the_lock_does_not_meet_is_reported(tmp_path):
    lock = tmp_path / "old.txt"
    pins = (
        (ROOT / "constraints" / "cpu-py311.txt")
        .read_text()
        .replace("\ntransformers==", "\ntransformers==4.0.")
    )
    lock.write_text(pins)
    assert any(
        p.startswith("transformers==4.0.") for p in unmet(lock, ["dev"], {**LINUX, "python_version": "3.11"})
    )
