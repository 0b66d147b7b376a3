"""Preflight: what a valid recipe can still get wrong at run time, checked before any rank starts.

`rl3d train`, `rl3d slurm` and `rl3d validate --preflight` run it in the launching process (and
`python -m rl3d.train` on every rank when started without the launcher). The config layer has
already checked the recipe as data; this module looks at the machine and the user's code:

- seeds and sizes in range: seeds in [0, 2**32), `data.max_prompt_length +
  rollout.max_new_tokens` within the model's positions, stop tokens inside the vocabulary;
- `model.hf_path` holds an HF directory (config.json + safetensors) or an rl3d Megatron weight
  directory whose shapes are those of `model.name` (`rl3d.models.spec.spec_of`), or, with the
  name unset, whose shapes the run takes;
- every `data.train_files` and `data.val_files` entry is a readable parquet file whose columns
  the data config can read (`rl3d.data.check_layout`): the prompt column, text or chat
  messages (the first row's messages well formed), the template's columns, the answer (when
  the reward needs answers) and data-source columns of a usable type; dotted keys reach into
  struct columns; prompts framed by the chat template need a tokenizer directory that has one;
- user code named as ``package.module:function`` (reward, cost, hooks, extra roles) imports;
- a Python tool (``rollout.agent.tools: {python: ...}``) gets its isolation here: a probe
  program runs under it (`rl3d.tools.python_sandbox.isolation_problem`), and a machine that
  cannot give it is refused naming what is missing (no fallback to a weaker mode);
- the recipe's per-rank memory plan fits the device (`rl3d.launch.preflight_memory`);
- the run directory (`check_run_dir`): a run never mixes with another. `checkpoint.resume:
  never` into a directory holding an earlier run is refused unless the user passes
  `--overwrite` (which deletes that run's outputs); a resolved_config.yaml that differs in
  anything but the restart keys is refused naming the keys; the checkpoint a restart would
  resume is verified against its manifest (sizes and CRC-32s): a damaged one is moved aside to
  ``step_N.damaged`` with a warning and the one before is used; one of another model or
  layout is refused naming both.

Each problem is a `PreflightError`: a `ConfigError` (exit 2) whose one line names the file
that set the key, the key, and the file or value at fault.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rl3d.config import ConfigError, LoadedConfig, run_dir_of
from rl3d.config.loader import RESOLVED_NAME, resolved_config_conflicts

SEED_LIMIT = 2**32  # numpy's legacy seeding (and most data tools) take 32-bit seeds


class PreflightError(ConfigError):
    """A run-time input problem found before any rank starts (exit 2, one line)."""


class _Check:
    def __init__(self, loaded: LoadedConfig, absent_ok: bool):
        self.loaded = loaded
        self.cfg = loaded.config
        self.absent_ok = absent_ok

    def fail(self, key: str, message: str) -> PreflightError:
        return PreflightError(message, key=key, source=self.loaded.source_of(key))


def preflight(
    loaded: LoadedConfig,
    *,
    check_paths: bool = True,
    absent_ok: bool = False,
    device_gib: float | None = None,
) -> None:
    """Raise `PreflightError` for the first problem.

    `check_paths=False` skips files and imports (what `rl3d validate` does without
    `--preflight`: the recipe may be meant for another machine). `absent_ok` skips input paths
    that do not exist here (`rl3d slurm` on a login node: the job checks them on its nodes).
    With `check_paths`, or a `device_gib`, the memory plan must fit the device
    (`rl3d.launch.preflight_memory`: the host's GPU, or `device_gib` GiB).
    """
    check = _Check(loaded, absent_ok)
    spec = _check_model(check, check_paths)
    _check_ranges(check, spec)
    if check_paths:
        _check_data(check)
        _check_imports(check)
        _check_tools(check)
        from rl3d.config.reward_model import preflight_reward_models

        preflight_reward_models(check.cfg, check.fail, absent_ok=absent_ok)
        from rl3d.config.run_dir import preflight_teachers

        preflight_teachers(check.cfg, check.fail, absent_ok=absent_ok)
    if check_paths or device_gib is not None:
        from rl3d.launch.preflight_memory import check_memory

        check_memory(loaded, device_gib)


def _check_ranges(check: _Check, spec: Any) -> None:
    cfg = check.cfg
    seeds = [("trainer.seed", cfg.trainer.seed)]
    if cfg.data.synthetic is not None:
        seeds.append(("data.synthetic.seed", cfg.data.synthetic.seed))
    for key, seed in seeds:
        if not 0 <= seed < SEED_LIMIT:
            raise check.fail(key, f"must be in [0, 2**32), got {seed}")
    longest = cfg.data.max_prompt_length + cfg.rollout.max_new_tokens
    if longest > spec.max_position_embeddings:
        raise check.fail(
            "rollout.max_new_tokens",
            f"data.max_prompt_length {cfg.data.max_prompt_length} + rollout.max_new_tokens "
            f"{cfg.rollout.max_new_tokens} = {longest} tokens exceeds {spec.name}'s "
            f"max_position_embeddings {spec.max_position_embeddings}",
        )
    for i, token in enumerate(cfg.rollout.stop_token_ids):
        if not 0 <= token < spec.vocab_size:
            raise check.fail(
                f"rollout.stop_token_ids[{i}]", f"{token} is outside the vocabulary [0, {spec.vocab_size})"
            )


def _check_model(check: _Check, check_paths: bool) -> Any:
    """The run's spec (`spec_of`: model.name's, which must agree with model.hf_path, or the
    shapes in hf_path when the name is unset); with `check_paths`, hf_path must hold weights."""
    from rl3d.models.spec import spec_of

    cfg = check.cfg
    hf_path = cfg.model.hf_path
    if check_paths and hf_path and not (check.absent_ok and not Path(hf_path).exists()):
        _spec_in(check, Path(hf_path))
    try:
        return spec_of(cfg.model)
    except ValueError as err:
        raise check.fail("model.hf_path", str(err)) from None


def _spec_in(check: _Check, path: Path) -> Any:
    from rl3d.models.convert import META_NAME, McoreMeta
    from rl3d.models.hf_mapping import spec_from_hf_config

    if not path.is_dir():
        raise check.fail("model.hf_path", f"{path}: no such directory")
    if (path / META_NAME).is_file():
        try:
            return McoreMeta.read(path).spec
        except (ValueError, KeyError, TypeError) as err:
            raise check.fail("model.hf_path", f"{path / META_NAME}: unreadable ({err})") from None
    config = path / "config.json"
    if not config.is_file():
        raise check.fail("model.hf_path", f"{path}: no config.json (nor {META_NAME}): not a model directory")
    try:
        spec = spec_from_hf_config(json.loads(config.read_text()), name=str(config))
    except (ValueError, KeyError, TypeError) as err:  # JSONDecodeError is a ValueError
        raise check.fail("model.hf_path", f"{config}: {type(err).__name__}: {err}") from None
    if not any(path.glob("*.safetensors")):
        raise check.fail("model.hf_path", f"{path}: no *.safetensors weights (.bin checkpoints unsupported)")
    return spec


def _check_data(check: _Check) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from rl3d.data import DataError, check_first_row, check_layout, template_columns
    from rl3d.data.columns import type_at
    from rl3d.data.images import check_images_of_first_row
    from rl3d.rewards import answer_check_for

    cfg = check.cfg
    tokenizer = cfg.data.tokenizer
    if tokenizer and ":" not in tokenizer and not Path(tokenizer).exists() and not check.absent_ok:
        raise check.fail("data.tokenizer", f"{tokenizer}: no such file or directory")
    if not cfg.data.train_files:
        return
    try:
        columns = template_columns(cfg.data.template)
    except DataError as err:
        raise check.fail("data.template", str(err)) from None
    needs_answer = answer_check_for(cfg.reward, cfg.data) is not None
    files = [(f"data.train_files[{i}]", name) for i, name in enumerate(cfg.data.train_files)]
    files += [(f"data.val_files[{i}]", name) for i, name in enumerate(cfg.data.val_files)]
    for key, name in files:
        if check.absent_ok and not Path(name).exists():
            continue
        if not Path(name).is_file():
            raise check.fail(key, f"{name}: no such file")
        try:
            schema = pq.read_schema(name)
        except (pa.ArrowException, OSError) as err:
            raise check.fail(key, f"{name}: not a readable parquet file ({_first_line(err)})") from None
        try:  # columns and their types; a messages column's first row (its roles)
            messages = check_layout(
                name, schema, cfg.data, template_columns=columns, needs_answer=needs_answer
            )
            check_first_row(name, cfg.data, messages=messages)
            check_images_of_first_row(name, cfg.data)  # the image column's type, row 0's images
        except DataError as err:
            raise check.fail(key, str(err)) from None
        if cfg.reward.fn_by_source is not None and type_at(schema, cfg.data.source_key) is None:
            raise check.fail(
                key,
                f"{name}: reward.fn_by_source needs each row's source, but the file has no column "
                f"{cfg.data.source_key!r} (data.source_key); its columns: {', '.join(schema.names)}",
            )
        if (messages or cfg.data.chat_template == "always") and not _has_chat_template(check):
            raise check.fail(
                "data.chat_template",
                f"{name}: the prompts need the tokenizer's chat template, but "
                f"{_tokenizer_dir(check) or 'the synthetic tokenizer'} has none",
            )


def _tokenizer_dir(check: _Check) -> str | None:
    """The run's HF tokenizer directory (None: a synthetic vocabulary)."""
    from rl3d.data.tokenizer import tokenizer_path
    from rl3d.utils.imports import is_import_path

    path = tokenizer_path(check.cfg.data, check.cfg.model.hf_path)
    return None if path is None or is_import_path(path) else path


def _has_chat_template(check: _Check) -> bool:
    """Whether the tokenizer directory has a chat template (transformers writes it to
    chat_template.jinja, older versions into tokenizer_config.json), read without loading it."""
    path = _tokenizer_dir(check)
    if path is None:
        return False
    directory = Path(path)
    if not directory.is_dir():
        return check.absent_ok  # checked where it exists
    if (directory / "chat_template.jinja").is_file() or (directory / "chat_template.json").is_file():
        return True
    config = directory / "tokenizer_config.json"
    try:
        return bool(config.is_file() and json.loads(config.read_text()).get("chat_template"))
    except ValueError:
        return False


def _check_imports(check: _Check) -> None:
    from rl3d.utils.imports import import_object, is_import_path

    cfg = check.cfg
    named = [("reward.fn", cfg.reward.fn), ("reward.cost_fn", cfg.reward.cost_fn)]
    named += [(f"reward.fn_by_source.{k}", v) for k, v in (cfg.reward.fn_by_source or {}).items()]
    named += [(f"trainer.hooks.{k}", v) for k, v in cfg.trainer.hooks.items()]
    named += [(f"roles.{k}.worker", r.worker) for k, r in cfg.roles.items()]
    for key, path in named:
        if path is None or not is_import_path(path):
            continue  # built-in names are checked with the config
        try:
            import_object(path, what=key)
        except ValueError as err:  # "KEY 'pkg.mod:fn': module 'pkg' not found"
            raise check.fail(key, _first_line(err).removeprefix(f"{key} ")) from None


def _check_tools(check: _Check) -> None:
    agent = check.cfg.rollout.agent
    if agent.kind != "tool_loop":
        return
    for name, tool in agent.build_tools().tools.items():
        problem = tool.preflight()
        if problem is not None:
            raise check.fail(
                f"rollout.agent.tools.{name}.isolation",
                f"the {name!r} tool cannot run here: {problem}",
            )


# What a run writes into its directory (`rl3d train --overwrite` removes these, nothing else).
RUN_OUTPUTS = (
    "checkpoints",
    "metrics.jsonl",
    "samples.jsonl",
    "metrics.csv",
    "tensorboard",
    "logs",
    "init_weights",
    "summary.txt",
    "reward_curve.png",
    RESOLVED_NAME,
)


def earlier_run(run_dir: Path) -> list[str]:
    """What an earlier run left in `run_dir` that a new one would mix with."""
    held = [name for name in ("metrics.jsonl",) if (run_dir / name).is_file()]
    ckpt = run_dir / "checkpoints"
    if ckpt.is_dir():
        held += sorted(p.name for p in ckpt.iterdir() if p.name.startswith("step_"))[-1:]
    return held


def clear_run_dir(run_dir: Path) -> list[str]:
    """Remove an earlier run's outputs (only the names in `RUN_OUTPUTS`); what was removed."""
    import shutil

    removed = []
    for name in [*RUN_OUTPUTS, *(p.name for p in run_dir.glob("resolved_config.*.yaml"))]:
        path = run_dir / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
        else:
            continue
        removed.append(name)
    return removed


def check_run_dir(loaded: LoadedConfig, *, overwrite: bool = False, launcher: bool = True) -> list[str]:
    """Refuse to mix two runs in one directory (see the module doc); returns what `overwrite`
    removed. `launcher=False` (on a rank) only reads: no CRC pass, nothing moved or removed."""
    from rl3d.checkpoint import CheckpointManager, CheckpointMismatch, checkpoint_identity

    check, cfg = _Check(loaded, False), loaded.config
    run_dir = run_dir_of(cfg)
    if overwrite:
        return clear_run_dir(run_dir) if launcher and run_dir.is_dir() else []
    held = earlier_run(run_dir)
    if cfg.checkpoint.resume == "never" and held:
        raise check.fail(
            "checkpoint.resume",
            f"'never', but {run_dir} holds an earlier run ({', '.join(held)}); "
            "`rl3d train --overwrite` deletes it and starts over, or set trainer.run_dir",
        )
    conflicts = resolved_config_conflicts(loaded, run_dir)
    if conflicts:
        more = f" and {len(conflicts) - 3} more" if len(conflicts) > 3 else ""
        raise check.fail(
            conflicts[0],
            f"{run_dir / RESOLVED_NAME} is another run's (it differs in {', '.join(conflicts[:3])}{more}); "
            "set trainer.run_dir, or `rl3d train --overwrite` to start over",
        )
    if cfg.checkpoint.resume == "auto":
        keep, identity = cfg.checkpoint.keep_last, checkpoint_identity(cfg)
        manager = CheckpointManager(run_dir / "checkpoints", keep_last=keep, identity=identity)
        try:
            manager.resume_point(checksums=launcher, quarantine=launcher)
        except CheckpointMismatch as err:
            raise check.fail("model.name" if err.field == "model" else "actor.parallel", str(err)) from None
    return []


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
