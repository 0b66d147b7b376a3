"""Nothing in the checkout shadows an installed module.

Python puts the working directory first on `sys.path` for `python -c`, `python -m`, a REPL or a
notebook (Ray workers get the driver's directory too), and pytest's default import mode puts every
test folder there. A regular module in such a folder (a `.py` file, a folder with `__init__.py`, an
extension module) is then imported in place of an installed distribution's top-level module of the
same name: rl3d's `kernels/__init__.py` once hid Hugging Face's `kernels`, which transformers
imports. A folder without `__init__.py` is only a namespace portion, which an installed regular
package of that name wins over, so `kernels/`, `yaml/` and the others may keep their names.
"""

from __future__ import annotations

import importlib.machinery
import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SKIP_DIRS = {"__pycache__", "node_modules"}


def importable_names(folder: Path) -> dict[str, Path]:
    """The names a Python with `folder` on its path imports from there as a regular module."""
    names: dict[str, Path] = {}
    for entry in folder.iterdir():
        if entry.is_dir() and (entry / "__init__.py").is_file():
            names[entry.name] = entry
        elif entry.is_file():
            for suffix in importlib.machinery.all_suffixes():
                stem = entry.name[: -len(suffix)]
                if entry.name.endswith(suffix) and stem.isidentifier():
                    names[stem] = entry
    return names


def folders_put_on_sys_path() -> list[Path]:
    """The checkout's root, and the folders a test or benchmark run puts first on `sys.path`:
    every test folder (pytest's prepend import mode), benchmarks/ and .ci/ (their scripts run directly)."""
    under = [
        p
        for top in ("tests", "benchmarks", ".ci")
        for p in [ROOT / top, *(ROOT / top).rglob("*")]
        if p.is_dir()
        and not any(part in SKIP_DIRS or part.startswith(".") for part in p.relative_to(ROOT / top).parts)
    ]
    return [ROOT, *under]


def test_no_regular_package_at_the_root():
    """Independent of what is installed: the root holds no regular package and no module but
    setup.py, so no distribution that a future release starts to need can be shadowed from it."""
    found = sorted(str(p.relative_to(ROOT)) for p in importable_names(ROOT).values())
    assert found == ["setup.py"], f"importable from the repository root: {found}"


def test_no_checkout_name_is_an_installed_top_level_module():
    installed = importlib.metadata.packages_distributions()
    clashes = [
        f"{path.relative_to(ROOT)} shadows {name!r} of {', '.join(sorted(set(installed[name])))}"
        for folder in folders_put_on_sys_path()
        for name, path in importable_names(folder).items()
        if name in installed
    ]
    assert not clashes, "\n".join(clashes)


SPECS = """
import importlib.metadata, importlib.util, json, sys
names = json.loads(sys.argv[1])
out = {}
for name in names:
    spec = importlib.util.find_spec(name)
    out[name] = [spec.origin, list(spec.submodule_search_locations or [])] if spec else None
print(json.dumps(out))
"""


def in_checkout(path: Path) -> bool:
    """Inside the checkout and not inside the environment (a `.venv` may live in the checkout)."""
    path = path.resolve()
    return path.is_relative_to(ROOT) and not path.is_relative_to(Path(sys.prefix).resolve())


def test_python_started_in_the_checkout_imports_the_installed_modules():
    """The real call sites: a `python -c` started at the root finds every installed module whose
    name is also an entry there (kernels, yaml, ...) in site-packages, and transformers, which
    imports Hugging Face's `kernels` when installed, imports from there."""
    installed = importlib.metadata.packages_distributions()
    at_root = sorted({p.name.split(".")[0] for p in ROOT.iterdir()} & set(installed))
    out = subprocess.run(
        [sys.executable, "-c", SPECS, json.dumps(at_root)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    for name, found in json.loads(out.stdout).items():
        assert found is not None, f"{name} is installed but not importable from {ROOT}"
        origin, locations = found
        inside = [p for p in [origin or "", *locations] if in_checkout(Path(p))]
        assert origin and not inside, f"{name} resolves into the checkout from its root: {found}"
    done = subprocess.run(
        [sys.executable, "-c", "from transformers import AutoModelForCausalLM, LlamaConfig"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-2000:]
