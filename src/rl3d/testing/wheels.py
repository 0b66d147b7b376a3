"""A pinned wheel's source for contract tests: downloaded once (`pip download --no-deps`) into the
git-ignored `.cache/wheels` of the checkout and read from the zip, never installed or imported.
rl3d checks the packages it cannot install here (SGLang, Megatron-Bridge: CUDA-only requirements)
against their own source this way."""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
CACHE = ROOT / ".cache" / "wheels"
# platform wheels differ by compiled parts only; any one of them has the same Python source
_PLATFORM = ["--only-binary=:all:", "--python-version", "3.11", "--platform", "manylinux_2_34_x86_64"]


@functools.cache
def pinned_wheel(project: str, version: str) -> Path | str:
    """The wheel of `project==version` (downloaded into CACHE on first use), or why there is none."""
    stem = project.replace("-", "_")
    found = sorted(CACHE.glob(f"{stem}-{version}-*.whl"))
    if found:
        return found[0]
    CACHE.mkdir(parents=True, exist_ok=True)
    errors = []
    for extra in ([], _PLATFORM):
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", *extra,
               f"{project}=={version}", "-d", str(CACHE)]  # fmt: skip
        try:
            run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.TimeoutExpired) as err:
            errors.append(str(err))
            continue
        found = sorted(CACHE.glob(f"{stem}-{version}-*.whl"))
        if found:
            return found[0]
        errors.append(run.stderr.strip().splitlines()[-1] if run.stderr.strip() else f"rc={run.returncode}")
    return f"could not download {project}=={version} (is PyPI reachable?): {'; '.join(errors)}"
