"""The pinned SGLang wheel's source, read with `ast`: never imported, never installed.

`rl3d.testing.wheels.pinned_wheel` fetches the wheel once into the git-ignored `.cache/wheels`
(tests skip, saying why, where PyPI is unreachable); the files are read from the zip directly.
"""

from __future__ import annotations

import ast
import functools
import re
import zipfile
from pathlib import Path

import pytest

from rl3d.rollout.sglang_weights import SGLANG_VERSION
from rl3d.testing.wheels import ROOT, pinned_wheel  # noqa: F401  (ROOT: re-exported to the tests)


def _wheel_path() -> Path | str:
    """The wheel's path, or why there is none."""
    return pinned_wheel("sglang", SGLANG_VERSION)


class Wheel:
    def __init__(self, path: Path):
        self.path = path
        self._zip = zipfile.ZipFile(path)

    def text(self, name: str) -> str:
        return self._zip.read(name).decode()

    def has(self, name: str) -> bool:
        try:
            self._zip.getinfo(name)
            return True
        except KeyError:
            return False

    @functools.cache  # noqa: B019  (one Wheel per session)
    def tree(self, name: str) -> ast.Module:
        return ast.parse(self.text(name), filename=name)

    def module_file(self, module: str) -> str | None:
        base = module.replace(".", "/")
        for name in (f"{base}.py", f"{base}/__init__.py"):
            if self.has(name):
                return name
        return None

    def defines(self, module: str, name: str) -> bool:
        """Whether `from module import name` finds a top-level def/class/assignment/import."""
        path = self.module_file(module)
        if path is None:
            return False
        if self.module_file(f"{module}.{name}") is not None:
            return True
        for node in self.tree(path).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
                return True
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                    return True
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                if any((a.asname or a.name.split(".")[0]) == name for a in node.names):
                    return True
            star = isinstance(node, ast.ImportFrom) and any(a.name == "*" for a in node.names)
            if star and not name.startswith("_") and self.defines(node.module, name):
                return True
        return False

    def class_node(self, path: str, name: str) -> ast.ClassDef:
        for node in ast.walk(self.tree(path)):
            if isinstance(node, ast.ClassDef) and node.name == name:
                return node
        raise AssertionError(f"no class {name} in {path}")

    def function_node(self, path: str, name: str) -> ast.FunctionDef:
        for node in self.tree(path).body:
            if isinstance(node, ast.FunctionDef) and node.name == name:
                return node
        raise AssertionError(f"no function {name} in {path}")

    # -- what rl3d relies on ---------------------------------------------------------------
    def version(self) -> str:
        meta = self.text(f"sglang-{SGLANG_VERSION}.dist-info/METADATA")
        return re.search(r"^Version: (\S+)$", meta, re.M).group(1)

    def requires(self) -> list[str]:
        meta = self.text(f"sglang-{SGLANG_VERSION}.dist-info/METADATA")
        return re.findall(r"^Requires-Dist: (.+)$", meta, re.M)

    def engine_methods(self) -> dict[str, ast.FunctionDef]:
        """Engine's methods, its bases' (EngineBase, the score mixin) under its own."""
        out: dict[str, ast.FunctionDef] = {}
        for path, cls in [
            ("sglang/srt/entrypoints/EngineBase.py", "EngineBase"),
            ("sglang/srt/entrypoints/engine_score_mixin.py", "EngineScoreMixin"),
            ("sglang/srt/entrypoints/engine.py", "Engine"),
        ]:
            if not self.has(path):
                continue
            for node in self.class_node(path, cls).body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not _is_abstract(node):
                    out[node.name] = node
        return out

    def server_args_fields(self) -> set[str]:
        """ServerArgs' fields: the annotated fields of its input namespaces (server_args.py's
        `_INPUT_NAMESPACES`, declared in sglang/srt/arg_groups/fields/)."""
        tree = self.tree("sglang/srt/server_args.py")
        namespaces: set[str] = set()
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "_INPUT_NAMESPACES" for t in node.targets
            ):
                namespaces = {e.id for e in node.value.elts}
        assert namespaces, "server_args.py has no _INPUT_NAMESPACES"
        fields: set[str] = set()
        seen: set[str] = set()
        for name in self._zip.namelist():
            if not (name.startswith("sglang/srt/arg_groups/fields/") and name.endswith(".py")):
                continue
            for node in self.tree(name).body:
                if isinstance(node, ast.ClassDef) and node.name in namespaces:
                    seen.add(node.name)
                    fields |= {
                        s.target.id
                        for s in node.body
                        if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
                        and not s.target.id.startswith("_")
                    }  # fmt: skip
        assert seen == namespaces, f"namespaces not found: {namespaces - seen}"
        return fields

    def sampling_param_fields(self) -> set[str]:
        cls = self.class_node("sglang/srt/sampling/sampling_params.py", "SamplingParams")
        return {s.target.id for s in cls.body if isinstance(s, ast.AnnAssign)}

    def dataclass_fields(self, path: str, name: str) -> list[str]:
        return [s.target.id for s in self.class_node(path, name).body if isinstance(s, ast.AnnAssign)]

    def memory_types(self) -> list[str]:
        tree = self.tree("sglang/srt/constants.py")
        values = {
            n.targets[0].id: n.value
            for n in tree.body
            if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Name)
        }
        return [ast.literal_eval(values[e.id]) for e in values["GPU_MEMORY_ALL_TYPES"].elts]

    def safe_unpickler_globals(self) -> set[tuple[str, str]]:
        cls = self.class_node("sglang/srt/utils/common.py", "SafeUnpickler")
        for node in cls.body:
            if isinstance(node, ast.Assign) and node.targets[0].id == "ALLOWED_GLOBALS":
                return set(ast.literal_eval(node.value))
        raise AssertionError("SafeUnpickler has no ALLOWED_GLOBALS")

    def env_writes(self) -> dict[str, str | None]:
        """`os.environ[NAME] = ...` in Engine's `_set_envs_and_config`: name -> the value when it
        is a literal (None when computed)."""
        fn = self.function_node("sglang/srt/entrypoints/engine.py", "_set_envs_and_config")
        out: dict[str, str | None] = {}
        for node in ast.walk(fn):
            if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Subscript):
                target = node.targets[0]
                if ast.unparse(target.value) == "os.environ":
                    value = node.value
                    out[ast.literal_eval(target.slice)] = (
                        value.value if isinstance(value, ast.Constant) else None
                    )
        return out

    def environ_flags(self) -> set[str]:
        """Names of the environment variables SGLang declares (sglang/srt/environ.py)."""
        return set(re.findall(r"^\s+(SGLANG_[A-Z0-9_]+) = Env", self.text("sglang/srt/environ.py"), re.M))


def _is_abstract(node: ast.AST) -> bool:
    return any(ast.unparse(d).endswith("abstractmethod") for d in getattr(node, "decorator_list", []))


def wheel_or_skip() -> Wheel:
    found = _wheel_path()
    if isinstance(found, str):
        pytest.skip(found)
    return _open(found)


@functools.lru_cache(maxsize=1)
def _open(path: Path) -> Wheel:
    return Wheel(path)


def param_names(fn: ast.FunctionDef) -> tuple[set[str], bool]:
    """(parameter names, takes **kwargs) of a parsed function."""
    a = fn.args
    names = {p.arg for p in [*a.posonlyargs, *a.args, *a.kwonlyargs]}
    return names, a.kwarg is not None
