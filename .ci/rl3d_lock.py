"""rl3d's locks: the exact version of every package an install resolved, in constraints/.

`make install` installs with `-c constraints/cpu-py311.txt`, so a fresh machine gets what the tests
passed with, whatever PyPI released since; `make lock` re-resolves setup.py's ranges in a scratch
virtualenv, runs the fast tier there and only then rewrites the lock (`write`); `make test-latest`
runs the fast tier on the newest versions and names each package that moved from the lock (`diff`).

    python .ci/rl3d_lock.py write LOCK        # this interpreter's environment -> LOCK
    python .ci/rl3d_lock.py diff LOCK         # what this environment has that LOCK does not
    python .ci/rl3d_lock.py gpu LOCK          # resolve the GPU install for its Python (no GPU needed)
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import re
import runpy
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OWN = "rl3d"
# The GPU machines: CPython 3.12 on x86_64 Linux with glibc 2.34 or newer (sglang 0.5.23's wheels
# need it). pip matches --platform tags exactly, so every manylinux tag such a machine takes is named.
GPU_PYTHON = "3.12"
GPU_PLATFORMS = [f"manylinux_2_{minor}_x86_64" for minor in range(34, 4, -1)] + [
    "manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64", "linux_x86_64",
]  # fmt: skip
# Transformer Engine's torch part ships as a source archive only, built against the installed torch
# (`make install-gpu`); the resolver, which sees wheels only for another platform, takes its
# requirements from the archive's own metadata instead and pins it at Transformer Engine's version.
SOURCE_ONLY = {"transformer-engine-torch": "transformer-engine"}
SOURCE_ONLY_EXTRA = "pytorch"  # the extra of transformer-engine that asks for transformer-engine-torch


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def installed() -> dict[str, str]:
    """name -> version of every distribution in this interpreter's environment, rl3d's own left out."""
    found = {canonical(d.metadata["Name"]): d.version for d in importlib.metadata.distributions()}
    found.pop(OWN, None)
    return found


def read(lock: Path) -> dict[str, str]:
    pins = {}
    for line in lock.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[canonical(name)] = version.split(";")[0].strip()
    return pins


def write(lock: Path, pins: dict[str, str], how: str) -> None:
    stamp = datetime.date.today().isoformat()
    header = [
        f"# rl3d's lock, written by {how} on {stamp}: exact versions, never edited by hand.",
        "# Change setup.py's ranges and run `make lock`; `make test-latest` shows what moved since.",
    ]
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.write_text("\n".join([*header, *(f"{n}=={v}" for n, v in sorted(pins.items()))]) + "\n")
    print(f"{lock}: {len(pins)} packages")


def diff(lock: Path) -> int:
    """Print each package whose version here differs from the lock; the number of them."""
    locked, here = read(lock), installed()
    rows = [
        (name, locked.get(name, "-"), here.get(name, "-"))
        for name in sorted(set(locked) | set(here))
        if locked.get(name) != here.get(name)
    ]
    print(f"{len(rows)} of {len(set(locked) | set(here))} packages differ from {lock.name}")
    if rows:
        width = max(len(r[0]) for r in rows)
        print(f"  {'package':<{width}}  {'lock':<14} newest")
        for name, old, new in rows:
            print(f"  {name:<{width}}  {old:<14} {new}")
    return len(rows)


def setup_requirements(extras: list[str]) -> list[str]:
    """setup.py's install_requires plus the named extras, as written there (markers included)."""
    import setuptools

    captured: dict = {}
    real, setuptools.setup = setuptools.setup, lambda **kw: captured.update(kw)
    try:
        runpy.run_path(str(ROOT / "setup.py"), run_name="__main__")
    finally:
        setuptools.setup = real
    return [*captured["install_requires"], *(r for e in extras for r in captured["extras_require"][e])]


def pip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True)


def source_requirements(name: str, version: str) -> list[str]:
    """Requires-Dist of a source archive's PKG-INFO, read from PyPI without building it (pip would
    install its build requirements, torch among them, to prepare the same metadata)."""
    import io
    import tarfile
    import urllib.request

    index = urllib.request.Request(
        f"https://pypi.org/simple/{name}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"}
    )
    with urllib.request.urlopen(index, timeout=60) as got:
        wanted = f"{name.replace('-', '_')}-{version}.tar.gz"
        url = next(f["url"] for f in json.load(got)["files"] if f["filename"] == wanted)
    with urllib.request.urlopen(url, timeout=300) as got:
        archive = io.BytesIO(got.read())
    with tarfile.open(fileobj=archive) as tar:
        member = next(m for m in tar.getmembers() if m.name.count("/") == 1 and m.name.endswith("/PKG-INFO"))
        text = tar.extractfile(member).read().decode()
    return [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Requires-Dist:")]


def resolve(requirements: list[str], scratch: Path) -> dict[str, str]:
    """pip's resolution of `requirements` for the GPU machines' Python and platform, installing nothing."""
    report = scratch / "report.json"
    platforms = [a for p in GPU_PLATFORMS for a in ("--platform", p)]
    got = pip(
        "install", "--dry-run", "--ignore-installed", "--only-binary=:all:", "--python-version", GPU_PYTHON,
        "--implementation", "cp", *platforms, "--report", str(report), "-q", *requirements,
    )  # fmt: skip
    if got.returncode:
        raise SystemExit(f"the GPU install does not resolve:\n{got.stderr[-3000:]}")
    items = json.loads(report.read_text())["install"]
    return {canonical(i["metadata"]["name"]): i["metadata"]["version"] for i in items}


def gpu_lock(lock: Path) -> None:
    """The GPU install ([gpu,dev]) resolved from the pinned packages' own requirements."""
    from packaging.requirements import Requirement

    wanted = [Requirement(r) for r in setup_requirements(["gpu", "dev"])]
    te = next(r for r in wanted if r.name == "transformer-engine")
    rest = [str(r) for r in wanted if r is not te]
    wheels = f"{te.name}[{','.join(sorted(te.extras - {SOURCE_ONLY_EXTRA}))}]"  # without the source part
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        pins = resolve([*rest, f"{wheels}{te.specifier}"], scratch)
        for source, sibling in SOURCE_ONLY.items():  # again, with the source part's own requirements
            extra = source_requirements(source, pins[sibling])
            pins = resolve([*rest, f"{wheels}=={pins[sibling]}", *extra], scratch)
            pins[source] = pins[sibling]
    write(lock, pins, f"`make lock-gpu` (resolved for CPython {GPU_PYTHON}, glibc 2.34, x86_64)")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("command", choices=["write", "diff", "gpu"])
    parser.add_argument("lock", type=Path)
    args = parser.parse_args()
    if args.command == "write":
        python = f"CPython {sys.version_info.major}.{sys.version_info.minor}"
        how = f"`.ci/rl3d_lock.py write` ({python}; `make lock` runs it once the fast tier passes)"
        write(args.lock, installed(), how)
    elif args.command == "diff":
        diff(args.lock)
    else:
        gpu_lock(args.lock)
    return 0


if __name__ == "__main__":
    sys.exit(main())
