"""A checkpoint's manifest: every file with its size and CRC-32, plus the model and layout.

`CheckpointManager.save` writes ``manifest.json`` last, after every rank's files and
``meta.json``, just before the directory is renamed into place. Resume checks it:

- `verify(directory, checksums=...)` names the first file that is missing, has another size
  (a truncated ``.distcp``, ``trainer_state.json`` or RNG file) or, with `checksums`, other bytes;
- `identity_problem(directory, identity)` says how the checkpoint's model or layout differ from
  the run's (a checkpoint of another run must not be loaded into this one).

Sizes cost one `stat` per file, so every rank checks them on resume. Checksums read every byte,
so only the launcher checks them, once, before the ranks start (`rl3d.launch.preflight`). The
CRCs are computed by a thread pool (zlib releases the GIL), reading files in 8 MiB blocks.
"""

from __future__ import annotations

import json
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

MANIFEST_FILE = "manifest.json"
_BLOCK = 8 * 2**20


class CheckpointMismatch(ValueError):
    """The newest checkpoint belongs to another model or layout than this run; `field` says
    which (``"model"`` or ``"layout"``)."""

    def __init__(self, message: str, *, field: str):
        super().__init__(message)
        self.field = field


def checkpoint_identity(cfg: Any) -> dict[str, str]:
    """What a checkpoint must share with the run that resumes it: the model's name and every
    resource pool's layout (``actor 1-2-1``, ``critic 1-1-2``; `cfg` is an `RL3DConfig`)."""
    from rl3d.config.pools import role_pools

    layout = ", ".join(f"{pool.name} {pool.layout}" for pool in role_pools(cfg))
    return {"model": cfg.model.label, "layout": layout}


def _crc32(path: Path) -> str:
    crc = 0
    with open(path, "rb") as fh:
        while block := fh.read(_BLOCK):
            crc = zlib.crc32(block, crc)
    return f"{crc:08x}"


def _files(directory: Path) -> list[Path]:
    files = (p for p in directory.rglob("*") if p.is_file())
    return sorted(p for p in files if p.relative_to(directory).as_posix() != MANIFEST_FILE)


def _checksums(directory: Path, files: list[Path]) -> list[str]:
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        return list(pool.map(_crc32, files))


def write_manifest(directory: str | os.PathLike, identity: dict[str, str] | None = None) -> dict[str, Any]:
    """Record every file under `directory` (sizes and CRC-32) and `identity`; written durably."""
    directory = Path(directory)
    files = _files(directory)
    crcs = _checksums(directory, files)
    record = {
        "identity": dict(identity or {}),
        "files": {
            p.relative_to(directory).as_posix(): {"size": p.stat().st_size, "crc32": crc}
            for p, crc in zip(files, crcs)
        },
    }
    path = directory / MANIFEST_FILE
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(record, fh, indent=1, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())
    return record


def read_manifest(directory: str | os.PathLike) -> dict[str, Any] | None:
    """The manifest, or None for a checkpoint written before manifests; ValueError if unreadable."""
    path = Path(directory) / MANIFEST_FILE
    if not path.exists():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        record["files"].items()
        return record
    except (ValueError, KeyError, AttributeError, TypeError) as err:
        raise ValueError(f"{path}: unreadable manifest ({type(err).__name__})") from None


def verify(directory: str | os.PathLike, *, checksums: bool = False) -> str | None:
    """None when the checkpoint is whole; else one line naming the damaged file.

    A checkpoint without a manifest (written by an older rl3d) cannot be checked: None.
    """
    directory = Path(directory)
    try:
        manifest = read_manifest(directory)
    except ValueError as err:
        return str(err)
    if manifest is None:
        return None
    entries = sorted(manifest["files"].items())
    for name, entry in entries:
        path = directory / name
        if not path.is_file():
            return f"{path}: missing"
        size = path.stat().st_size
        if size != entry["size"]:
            return f"{path}: {size} bytes, the manifest says {entry['size']} (truncated or overwritten)"
    if checksums:
        paths = [directory / name for name, _ in entries]
        for (name, entry), crc in zip(entries, _checksums(directory, paths)):
            if crc != entry["crc32"]:
                return f"{directory / name}: CRC-32 {crc}, the manifest says {entry['crc32']} (corrupted)"
    return None


def identity_problem(directory: str | os.PathLike, identity: dict[str, str]) -> CheckpointMismatch | None:
    """None when the checkpoint's model and layout are `identity`'s (or it records none)."""
    manifest = read_manifest(directory) or {}
    saved = manifest.get("identity") or {}
    for key in ("model", "layout"):
        if key in saved and key in identity and saved[key] != identity[key]:
            return CheckpointMismatch(
                f"{directory} holds {key} {saved[key]!r}, this run has {key} {identity[key]!r}; "
                "resume it with its own recipe, or start this one in another trainer.run_dir",
                field=key,
            )
    return None
