"""Resolve user code named in a recipe as ``"package.module:attribute"`` (never `eval`).

Reward functions (`reward.fn`) and trainer hooks (`trainer.hooks.*`) both name user code this
way. Every failure is a `ValueError` that names the path and says what went wrong: a path
without exactly one ``:``, a module that is not importable, a module that fails while importing
(its own traceback is chained), a missing attribute, or an object that is not callable.
"""

from __future__ import annotations

import difflib
import importlib
import os
import re
import sys
from collections.abc import Iterable
from typing import Any

_MODULE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
# The directory `rl3d train` ran in. The processes it starts run with PYTHONSAFEPATH, so that
# directory is not ahead of the installed packages; user code is looked up there after them.
LAUNCH_DIR_ENV = "RL3D_LAUNCH_DIR"


def _search_launch_dir() -> None:
    launch_dir = os.environ.get(LAUNCH_DIR_ENV)
    if launch_dir and launch_dir not in sys.path:
        sys.path.append(launch_dir)


def is_import_path(name: str) -> bool:
    """Whether `name` looks like ``module:attr`` rather than a registered bare name."""
    return ":" in name


def import_object(path: str, *, what: str = "object", require_callable: bool = True) -> Any:
    """The object at ``"package.module:attr"`` (``attr`` may be dotted, e.g. ``Cls.method``).

    `what` names the role in error messages ("reward function", "hook on_step_end").
    """
    module_name, sep, attr_path = path.partition(":")
    if not sep or not module_name or not attr_path or ":" in attr_path:
        raise ValueError(f"{what} {path!r}: expected 'package.module:function'")
    if not _MODULE.match(module_name):
        raise ValueError(f"{what} {path!r}: {module_name!r} is not a module name")
    if not all(part.isidentifier() for part in attr_path.split(".")):
        raise ValueError(f"{what} {path!r}: {attr_path!r} is not an attribute name")
    _search_launch_dir()
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        # Distinguish "this module does not exist" from "it exists but imports a missing one".
        missing = err.name or ""
        if module_name == missing or module_name.startswith(missing + "."):
            raise ValueError(f"{what} {path!r}: module {module_name!r} not found") from err
        raise ValueError(f"{what} {path!r}: importing {module_name!r} failed: {err}") from err
    except Exception as err:
        raise ValueError(f"{what} {path!r}: importing {module_name!r} failed: {err!r}") from err
    obj: Any = module
    for depth, part in enumerate(attr_path.split(".")):
        if not hasattr(obj, part):
            owner = module_name if depth == 0 else f"{module_name}:{'.'.join(attr_path.split('.')[:depth])}"
            names = [n for n in dir(obj) if not n.startswith("_")]
            raise ValueError(f"{what} {path!r}: {owner!r} has no attribute {part!r}{suggest(part, names)}")
        obj = getattr(obj, part)
    if require_callable and not callable(obj):
        raise ValueError(f"{what} {path!r}: {type(obj).__name__} object is not callable")
    return obj


def suggest(name: str, known: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest known name, or an empty string."""
    close = difflib.get_close_matches(name, list(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def describe_callable(fn: Any) -> str:
    """``module:qualname`` of a function (or its repr) for error messages."""
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    if module and qualname:
        return f"{module}:{qualname}"
    return repr(fn)


def lazy_attributes(package: str, where: dict[str, str]):
    """A package's `__getattr__` that imports `name` from module `where[name]` on first use, so
    importing the package stays light (no torch, no megatron) until the name is needed."""

    def __getattr__(name: str) -> Any:
        if name in where:
            return getattr(importlib.import_module(where[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
