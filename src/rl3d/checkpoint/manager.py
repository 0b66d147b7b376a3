"""`CheckpointManager`: one directory per saved step, made visible atomically.

    root/step_00000010/      complete: rank files + meta.json, renamed into place by rank 0
    root/step_00000020.tmp/  being written (or left by a killed run): never loaded

Every rank calls `save` with the same step. Rank 0 clears leftover ``.tmp`` directories and
makes ``step_N.tmp``; after a barrier every rank's `write_fn(tmp_dir)` writes its own files;
after a second barrier rank 0 writes ``meta.json``, then ``manifest.json`` (every file's size and
CRC-32, the model and the layout: `rl3d.checkpoint.manifest`), and renames the directory to ``step_N``
(``os.replace``: atomic on one filesystem), then prunes all but the newest `keep_last`. A third
barrier makes the checkpoint visible to every rank before `save` returns. A crash anywhere
before the rename leaves only a ``.tmp`` directory, which `latest()` ignores and the next save
deletes. `root` must be one directory seen by all ranks (local disk on one node, a shared
filesystem across nodes).

`resume_point()` is the newest checkpoint that is whole: a damaged one (a file missing or of
another size, or with `checksums` other bytes) is named in a warning and skipped, or with
`quarantine` moved aside to ``step_N.damaged``; one of another model or layout raises
`rl3d.checkpoint.CheckpointMismatch`.

`barrier` is any zero-argument callable: ``torch.distributed.barrier`` in a run, a no-op in one
process. If a rank's `write_fn` raises, that rank raises; the others wait in the barrier until
the process group's timeout, and nothing incomplete ever becomes a checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rl3d.checkpoint.manifest import identity_problem, verify, write_manifest

logger = logging.getLogger(__name__)

META_FILE = "meta.json"
FORMAT_VERSION = 1
_COMPLETE = re.compile(r"^step_(\d{8,})$")
_TMP_SUFFIX = ".tmp"
_TRASH_SUFFIX = ".trash"
DAMAGED_SUFFIX = ".damaged"


def _no_barrier() -> None:
    pass


class CheckpointManager:
    def __init__(self, root: str | os.PathLike, *, keep_last: int, identity: dict[str, str] | None = None):
        """`identity` (``{"model": ..., "layout": ...}``, see `checkpoint_identity`) is recorded in
        every manifest and must match on resume."""
        if keep_last < 1:
            raise ValueError(f"CheckpointManager: keep_last must be >= 1, got {keep_last}")
        self.root = Path(root)
        self.keep_last = keep_last
        self.identity = dict(identity or {})

    def path_for(self, step: int) -> Path:
        return self.root / f"step_{step:08d}"

    def checkpoints(self) -> list[tuple[int, Path]]:
        """Complete checkpoints (named ``step_N`` and holding ``meta.json``), oldest first."""
        if not self.root.is_dir():
            return []
        found = []
        for path in self.root.iterdir():
            match = _COMPLETE.match(path.name)
            if match and path.is_dir() and (path / META_FILE).is_file():
                found.append((int(match.group(1)), path))
        return sorted(found)

    def latest(self) -> tuple[int, Path] | None:
        found = self.checkpoints()
        return found[-1] if found else None

    def resume_point(self, *, checksums: bool = False, quarantine: bool = False) -> tuple[int, Path] | None:
        """The newest whole checkpoint of this model and layout, or None.

        Damaged ones are skipped with a warning naming the file (every rank decides alike from
        the same files); `quarantine` also renames them ``step_N.damaged`` (one process only:
        the launcher). Raises `CheckpointMismatch` when the newest whole one is another run's.
        """
        for step, path in reversed(self.checkpoints()):
            problem = verify(path, checksums=checksums)
            if problem is None:
                mismatch = identity_problem(path, self.identity)
                if mismatch is not None:
                    raise mismatch
                return step, path
            if quarantine:
                aside = _free_name(path.with_name(path.name + DAMAGED_SUFFIX))
                os.replace(path, aside)
                what = f"moved it to {aside.name}"
            else:
                what = "skipping it"
            logger.warning("damaged checkpoint %s (%s): %s, trying the one before", path.name, problem, what)
        return None

    def save(
        self,
        step: int,
        write_fn: Callable[[Path], Any],
        *,
        rank: int = 0,
        world_size: int = 1,
        barrier: Callable[[], Any] = _no_barrier,
        meta: dict[str, Any] | None = None,
    ) -> Path:
        """Write checkpoint `step` (every rank calls this); returns its final directory.

        `meta` (JSON-serialisable, rank 0's is used) is merged into ``meta.json``.
        """
        if step < 0:
            raise ValueError(f"CheckpointManager.save: step must be >= 0, got {step}")
        final = self.path_for(step)
        tmp = final.with_name(final.name + _TMP_SUFFIX)
        if rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            self._remove_leftovers()
            tmp.mkdir()
        barrier()
        write_fn(tmp)
        barrier()
        if rank == 0:
            record = {
                "step": step,
                "time": time.time(),
                "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "world_size": world_size,
                "format_version": FORMAT_VERSION,
                **(meta or {}),
            }
            _write_json_durably(tmp / META_FILE, record)
            write_manifest(tmp, self.identity)  # last: it lists every other file
            if final.exists():  # saving a step again (e.g. after a resume): replace the old copy
                self._discard(final)
            os.replace(tmp, final)
            _fsync_dir(self.root)
            self._prune()
            logger.info("saved checkpoint %s", final)
        barrier()
        return final

    def _remove_leftovers(self) -> None:
        for path in self.root.iterdir():
            if path.is_dir() and path.name.endswith((_TMP_SUFFIX, _TRASH_SUFFIX)):
                logger.warning("removing incomplete checkpoint directory %s", path)
                shutil.rmtree(path, ignore_errors=True)

    def _prune(self) -> None:
        for _, path in self.checkpoints()[: -self.keep_last]:
            self._discard(path)

    def _discard(self, path: Path) -> None:
        # Rename first, so a crash while deleting never leaves a half-deleted `step_N`.
        trash = path.with_name(path.name + _TRASH_SUFFIX)
        os.replace(path, trash)
        shutil.rmtree(trash, ignore_errors=True)


def _free_name(path: Path) -> Path:
    candidate, n = path, 1
    while candidate.exists():
        candidate, n = path.with_name(f"{path.name}{n}"), n + 1
    return candidate


def load_meta(path: str | os.PathLike) -> dict[str, Any]:
    """The ``meta.json`` of a checkpoint directory."""
    with open(Path(path) / META_FILE, encoding="utf-8") as fh:
        return json.load(fh)


def _write_json_durably(path: Path, record: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(record, fh, indent=2, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # e.g. platforms without directory file descriptors
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
