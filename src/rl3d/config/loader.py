"""Load a recipe: `defaults:` blocks from yaml/, then the recipe's keys, then CLI overrides.

Composition is explicit and shallow to read: each block is plain data, applied in the order the
`defaults:` list names them (a block may list its own defaults, applied before it); mappings
merge key by key, anything else (lists included) is replaced. No interpolation. Every key
remembers which file set it last, so an error can name the file.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from rl3d.config.agent import adopt_multi_turn
from rl3d.config.checks import check_config
from rl3d.config.errors import ConfigError
from rl3d.config.renames import adopt_renamed
from rl3d.config.rm_job import RM_JOB, RMJobConfig, check_rm_job
from rl3d.config.schema import RL3DConfig
from rl3d.config.typed import from_dict, to_dict

COMMAND_LINE = "command line"
RESOLVED_NAME = "resolved_config.yaml"


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader plus YAML 1.2 floats: `1e-3` is a number, not the string '1e-3'.

    YAML 1.1 (PyYAML's default) needs a dot in a float's mantissa; recipes and overrides are
    written by people who type `lr=1e-3`.
    """


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def yaml_load(text: str) -> Any:
    """Parse recipe YAML (safe, with YAML 1.2 exponent floats)."""
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - _Loader is a SafeLoader


@dataclass
class _Merged:
    data: dict[str, Any] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)  # dotted key -> file that set it
    files: list[str] = field(default_factory=list)  # every file read, in order

    def merge(self, incoming: dict[str, Any], source: str, prefix: str = "", into: dict | None = None):
        into = self.data if into is None else into
        for key, value in incoming.items():
            dotted = f"{prefix}.{key}" if prefix else str(key)
            self.sources[dotted] = source
            if isinstance(value, dict) and isinstance(into.get(key), dict):
                self.merge(value, source, dotted, into[key])
            else:
                into[key] = _copy(value)
                if isinstance(value, dict):
                    for sub in _dotted_keys(value, dotted):
                        self.sources[sub] = source

    def source_of(self, key: str) -> str | None:
        while key:
            base = key.split("[", 1)[0]
            if base in self.sources:
                return self.sources[base]
            key = base.rpartition(".")[0]
        return self.files[-1] if self.files else None


def _copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value


def _dotted_keys(data: dict[str, Any], prefix: str):
    for key, value in data.items():
        dotted = f"{prefix}.{key}"
        yield dotted
        if isinstance(value, dict):
            yield from _dotted_keys(value, dotted)


def find_yaml_root(recipe: Path) -> Path:
    """The folder of reusable blocks: $RL3D_YAML_DIR, else the nearest `yaml/` above the recipe."""
    env = os.environ.get("RL3D_YAML_DIR")
    if env:
        return Path(env)
    for parent in [recipe.resolve().parent, *recipe.resolve().parents]:
        if (parent / "yaml").is_dir():
            return parent / "yaml"
    return Path.cwd() / "yaml"


def _display(path: Path) -> str:
    """A path as the user would type it: relative to the working directory when inside it."""
    try:
        return str(path.relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def _read_yaml(path: Path, included_from: str | None) -> dict[str, Any]:
    if not path.is_file():
        where = f" (listed in defaults of {included_from})" if included_from else ""
        raise ConfigError(f"file not found{where}", source=_display(path))
    try:
        data = yaml_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        line = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(
            f"invalid YAML{line}: {getattr(err, 'problem', err)}", source=_display(path)
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(f"top level must be a mapping, got {type(data).__name__}", source=_display(path))
    return data


def _resolve_block(entry: Any, yaml_root: Path, including: Path) -> Path:
    if not isinstance(entry, str) or not entry:
        raise ConfigError(
            f"each defaults entry must be a block path string, got {entry!r}",
            key="defaults",
            source=str(including),
        )
    name = entry if entry.endswith((".yaml", ".yml")) else f"{entry}.yaml"
    if name.startswith(("./", "../")):
        return (including.parent / name).resolve()
    return (yaml_root / name).resolve()


def _apply_file(path: Path, merged: _Merged, yaml_root: Path, chain: list[Path], parent: str | None):
    if path in chain:
        cycle = " -> ".join(str(p) for p in [*chain[chain.index(path) :], path])
        raise ConfigError(f"cycle in defaults: {cycle}", key="defaults", source=str(chain[-1]))
    data = _read_yaml(path, parent)
    defaults = data.pop("defaults", [])
    if not isinstance(defaults, list):
        raise ConfigError("defaults must be a list of block paths", key="defaults", source=_display(path))
    for entry in defaults:
        block = _resolve_block(entry, yaml_root, path)
        _apply_file(block, merged, yaml_root, [*chain, path], _display(path))
    merged.files.append(_display(path))
    merged.merge(data, _display(path))


def parse_override(text: str) -> tuple[str, Any]:
    key, sep, raw = text.partition("=")
    key = key.strip().lstrip("+")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r} is not of the form key.sub=value", source=COMMAND_LINE)
    try:
        value = yaml_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key, value


def _nest(key: str, value: Any) -> dict[str, Any]:
    out: dict[str, Any] = value
    for part in reversed(key.split(".")):
        out = {part: out}
    return out


@dataclass(frozen=True)
class LoadedConfig:
    config: RL3DConfig  # or, for a `job: reward_model` recipe, an RMJobConfig
    recipe: str
    files: list[str]  # every YAML file read, in the order applied
    overrides: list[str]
    sources: dict[str, str]

    def source_of(self, key: str) -> str | None:
        return _Merged(sources=self.sources, files=self.files).source_of(key)


def load_config(recipe: str | os.PathLike, overrides: list[str] | tuple[str, ...] = ()) -> LoadedConfig:
    """Load, compose, type and check a recipe. Raises ConfigError naming file and key."""
    path = Path(recipe)
    merged = _Merged()
    _apply_file(path.resolve(), merged, find_yaml_root(path), [], None)
    for text in overrides:
        key, value = parse_override(text)
        merged.merge(_nest(key, value), COMMAND_LINE)
    if merged.data.get("job") == RM_JOB:  # a reward-model training recipe (rl3d.controller.rm_train)
        cfg = from_dict(RMJobConfig, merged.data, source_of=merged.source_of)
        check_rm_job(cfg, lambda key, msg: ConfigError(msg, key=key, source=merged.source_of(key)))
        return LoadedConfig(cfg, str(path), list(merged.files), list(overrides), dict(merged.sources))
    adopt_renamed(merged.data, merged.sources, merged.source_of)  # former names still load
    adopt_multi_turn(merged.data, merged.sources, merged.source_of)  # the tool loop's former key
    cfg = from_dict(RL3DConfig, merged.data, source_of=merged.source_of)
    check_config(cfg, merged.source_of)
    return LoadedConfig(cfg, str(path), list(merged.files), list(overrides), dict(merged.sources))


def config_to_yaml(cfg: RL3DConfig) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=False)


# Keys a restart of the same run may change: how long it runs, how often it saves, what it logs,
# how it is launched. Anything else would continue a run with another recipe.
RESTART_KEYS = (
    "description",
    "trainer.total_steps",
    "trainer.run_dir",  # a run dir that was moved or copied
    "trainer.hooks",
    "checkpoint",
    "logging",
    "launch.backend",
    "launch.ray_address",
    "launch.slurm",
    "hybrid_engine.timeout_s",
    "hybrid_engine.verify",
    "reward.num_workers",
)


def _flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(data, dict) and data:
        out: dict[str, Any] = {}
        for key, value in data.items():
            out.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: data}


def resolved_config_conflicts(loaded: LoadedConfig, run_dir: str | os.PathLike) -> list[str]:
    """Dotted keys in which `run_dir`'s resolved_config.yaml differs from `loaded` (restart keys
    aside); empty when there is none. An unreadable file is a conflict named by its path."""
    path = Path(run_dir) / RESOLVED_NAME
    if not path.is_file():
        return []
    try:
        old = _flatten(yaml_load(path.read_text()) or {})
    except yaml.YAMLError:
        return [f"{path} (unreadable)"]
    new = _flatten(to_dict(loaded.config))
    differ = sorted(k for k in old.keys() | new.keys() if old.get(k, _MISSING) != new.get(k, _MISSING))
    return [k for k in differ if not any(k == r or k.startswith(r + ".") for r in RESTART_KEYS)]


_MISSING = object()


def write_resolved_config(loaded: LoadedConfig, run_dir: str | os.PathLike) -> Path:
    """Write the fully resolved config next to the run's logs; it alone reproduces the run.

    A run dir's config is never replaced by a different one: a conflict in any key but the
    `RESTART_KEYS` raises ConfigError naming the keys. When only restart keys changed, the
    previous file is kept as ``resolved_config.<n>.yaml``.
    """
    out = Path(run_dir)
    out.mkdir(parents=True, exist_ok=True)
    target = out / RESOLVED_NAME
    conflicts = resolved_config_conflicts(loaded, out)
    if conflicts:
        raise ConfigError(
            f"{target} holds another run's config (differs in {', '.join(conflicts[:5])}"
            f"{', ...' if len(conflicts) > 5 else ''}); set trainer.run_dir, or start over with --overwrite",
            key=conflicts[0] if conflicts[0] in _flatten(to_dict(loaded.config)) else None,
        )
    header = [f"# resolved by rl3d from {loaded.recipe}", "# files applied, in order:"]
    header += [f"#   {f}" for f in loaded.files]
    header += [f"# command-line overrides: {' '.join(loaded.overrides) or '(none)'}"]
    text = "\n".join(header) + "\n" + config_to_yaml(loaded.config)
    if target.is_file() and yaml_load(target.read_text()) != to_dict(loaded.config):
        n = 1
        while (kept := out / f"resolved_config.{n}.yaml").exists():
            n += 1
        target.replace(kept)  # a restart that changed only restart keys: keep what ran before
    tmp = target.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(target)
    return target


def run_dir_of(cfg: RL3DConfig) -> Path:
    return Path(cfg.trainer.run_dir or Path("runs") / cfg.trainer.experiment)
