"""Stream safetensors files one tensor at a time, in both directions.

`safetensors.torch.save_file` needs every tensor in memory at once; a 70B checkpoint does not
fit. The format is simple (8-byte header length, JSON header, raw little-endian data), so a
writer that knows every name, dtype and shape up front writes the header first and then each
tensor as it comes. Reading uses `safe_open`, which memory-maps and reads one tensor per call.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

_DTYPE_NAMES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_NAME_DTYPES = {v: k for k, v in _DTYPE_NAMES.items()}
INDEX_NAME = "model.safetensors.index.json"


def dtype_from_name(name: str) -> torch.dtype:
    if name not in _NAME_DTYPES:
        raise ValueError(f"unsupported safetensors dtype {name}")
    return _NAME_DTYPES[name]


class StreamingWriter:
    """Write one safetensors file whose tensors (name, dtype, shape) are all known up front.

    Tensors must then be written in exactly the planned order; `close()` checks they all came.
    """

    def __init__(self, path: str | Path, plan: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> None:
        self.path = Path(path)
        self._plan = list(plan)
        self._next = 0
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, dtype, shape in self._plan:
            nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            header[name] = {
                "dtype": _DTYPE_NAMES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "wb")  # noqa: SIM115 - closed in close()
        self._file.write(struct.pack("<Q", len(raw)))
        self._file.write(raw)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        assert self._next < len(self._plan), f"{self.path}: unplanned tensor {name}"
        want_name, want_dtype, want_shape = self._plan[self._next]
        assert name == want_name, f"{self.path}: got {name}, planned {want_name} next"
        assert tensor.dtype == want_dtype and tuple(tensor.shape) == tuple(want_shape), (
            name,
            tensor.dtype,
            tuple(tensor.shape),
            want_dtype,
            want_shape,
        )
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        self._file.write(memoryview(data.numpy()))
        self._next += 1

    def close(self) -> None:
        self._file.close()
        if self._next != len(self._plan):
            missing = [name for name, _, _ in self._plan[self._next :]]
            os.remove(self.path)
            raise RuntimeError(f"{self.path}: {len(missing)} planned tensors never written: {missing[:5]}")


class ShardedReader:
    """Read tensors by name from a directory of safetensors files (with or without an index)."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        index = self.directory / INDEX_NAME
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
        else:
            files = sorted(self.directory.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(
                    f"no *.safetensors in {self.directory} (.bin checkpoints unsupported)"
                )
            weight_map = {}
            for path in files:
                with _safe_open(path) as f:
                    weight_map.update({k: path.name for k in f.keys()})
        missing = sorted({f for f in weight_map.values() if not (self.directory / f).is_file()})
        if missing:
            raise FileNotFoundError(f"{self.directory / missing[0]}: missing (listed in {INDEX_NAME})")
        self.weight_map: dict[str, str] = weight_map
        self._stack = ExitStack()
        self._handles: dict[str, Any] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def _handle(self, name: str) -> Any:
        file = self.weight_map[name]
        if file not in self._handles:
            self._handles[file] = self._stack.enter_context(_safe_open(self.directory / file))
        return self._handles[file]

    def get(self, name: str) -> torch.Tensor:
        if name not in self.weight_map:
            raise ValueError(f"{self.directory}: no tensor {name!r} in the checkpoint")
        try:
            return self._handle(name).get_tensor(name)
        except ValueError:
            raise
        except Exception as err:  # safetensors' own error type: a truncated or damaged file
            raise ValueError(f"{self.directory / self.weight_map[name]}: tensor {name!r}: {err}") from err

    def dtype(self, name: str) -> torch.dtype:
        if name not in self.weight_map:
            raise ValueError(f"{self.directory}: no tensor {name!r} in the checkpoint")
        return dtype_from_name(self._handle(name).get_slice(name).get_dtype())

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> ShardedReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _safe_open(path: Path) -> Any:
    from safetensors import safe_open

    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except Exception as err:  # SafetensorError: truncated header, not a safetensors file
        raise ValueError(f"{path}: not a readable safetensors file ({err})") from err


def split_into_files(
    plan: list[tuple[str, torch.dtype, tuple[int, ...]]], max_bytes: int
) -> Iterator[list[tuple[str, torch.dtype, tuple[int, ...]]]]:
    """Consecutive groups of the plan, each under `max_bytes` unless one tensor alone is bigger."""
    group: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
    size = 0
    for item in plan:
        nbytes = torch.Size(item[2]).numel() * torch.empty((), dtype=item[1]).element_size()
        if group and size + nbytes > max_bytes:
            yield group
            group, size = [], 0
        group.append(item)
        size += nbytes
    if group:
        yield group
