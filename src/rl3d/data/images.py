"""Images in prompt rows: verl's multimodal parquet layout.

A file with the column `data.image_key` (default ``images``) gives each row a list of images, each
one of what verl and HF ``datasets`` write:

- a struct ``{"bytes": ..., "path": ...}`` (an ``Image()`` feature): the encoded bytes when they
  are there, else the path;
- a struct ``{"image": path}`` (verl's Qwen2-VL examples);
- encoded bytes (PNG, JPEG, ... whatever PIL reads), or a path string. A relative path is
  resolved against the parquet file's folder; ``file://`` is stripped.

The prompt holds one `data.image_placeholder` (``<image>``) per image, in its chat messages'
contents or in its formatted text; the count must equal the row's number of images. An item keeps
its images as `ImageRef`s (bytes or an absolute path), not decoded pixels: a dataset of many images
stays small, and each is decoded where it is used (`RuntimeImages`).

Loading decodes every image once to check it: a row whose image does not decode, or whose counts
differ, is a bad row naming the file, the row and the key (`rl3d.data.dataset`). A file whose image
column is of another type is a `DataError` naming the file and the key; the preflight checks the
type and the first row (`check_image_column`, `check_images_of_first_row`). An image that fails
at run time (a path whose file has gone or changed since loading) is reported and counted by
`RuntimeImages`, which hands back None for the prompt instead of raising.
"""

from __future__ import annotations

import io
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rl3d.data.columns import column_of, type_at, value_at
from rl3d.data.errors import DataError

IMAGES = "images"  # the rollout batch's column of each row's encoded images (`ImageRef`s)

logger = logging.getLogger(__name__)

ImageRef = bytes | str  # encoded bytes, or an absolute path
_PATH_FIELDS = ("path", "image")
_MAX_LOGGED = 20


def _is_image_item_type(kind: Any) -> bool:
    import pyarrow as pa

    if pa.types.is_binary(kind) or pa.types.is_large_binary(kind) or pa.types.is_string(kind):
        return True
    if pa.types.is_large_string(kind) or pa.types.is_null(kind):
        return True
    return pa.types.is_struct(kind) and any(
        kind.get_field_index(name) >= 0 for name in ("bytes", *_PATH_FIELDS)
    )


def check_image_column(path: str, schema: Any, cfg: Any) -> str | None:
    """The image key when `path`'s schema has it (None: a text-only file); DataError naming the
    file and the key when its type holds no images."""
    import pyarrow as pa

    kind = type_at(schema, cfg.image_key)
    if kind is None:
        return None
    is_list = pa.types.is_list(kind) or pa.types.is_large_list(kind)
    if not (pa.types.is_null(kind) or (is_list and _is_image_item_type(kind.value_type))):
        raise DataError(
            f"{path}: column {cfg.image_key!r} (data.image_key) is {kind}, expected a list of images "
            "(structs {bytes, path}, binary, or path strings)"
        )
    return cfg.image_key


def image_refs(value: Any, base_dir: Path) -> list[ImageRef]:
    """A row's image column as `ImageRef`s; ValueError naming the first entry that is none."""
    if value is None:
        return []
    refs: list[ImageRef] = []
    for i, entry in enumerate(value):
        ref: Any = entry
        if isinstance(entry, dict):
            ref = entry.get("bytes") or next((entry[k] for k in _PATH_FIELDS if entry.get(k)), None)
        if isinstance(ref, bytes | bytearray):
            refs.append(bytes(ref))
        elif isinstance(ref, str) and ref:
            local = Path(ref.removeprefix("file://"))
            refs.append(str(local if local.is_absolute() else base_dir / local))
        else:
            raise ValueError(f"image {i} is {entry!r:.80}, neither encoded bytes nor a path")
    return refs


def decode_image(ref: ImageRef) -> Any:
    """The image as an RGB `PIL.Image.Image`, fully decoded; ValueError saying why not."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(ref) if isinstance(ref, bytes) else ref) as image:
            image.load()
            return image.convert("RGB")
    except (OSError, UnidentifiedImageError, Image.DecompressionBombError, SyntaxError) as err:
        where = f"{len(ref)} bytes" if isinstance(ref, bytes) else ref
        raise ValueError(f"cannot decode ({where}): {err}") from None


def count_placeholders(texts: list[str], placeholder: str) -> int:
    return sum(text.count(placeholder) for text in texts)


def check_row_images(refs: list[ImageRef], texts: list[str], cfg: Any) -> None:
    """ValueError naming the key unless every image decodes and the prompt's placeholders match."""
    for i, ref in enumerate(refs):
        try:
            decode_image(ref)
        except ValueError as err:
            raise ValueError(f"image {i} of column {cfg.image_key!r}: {err}") from None
    placeholders = count_placeholders(texts, cfg.image_placeholder)
    if placeholders != len(refs):
        raise ValueError(
            f"column {cfg.prompt_key!r} has {placeholders} {cfg.image_placeholder} placeholder(s) "
            f"but column {cfg.image_key!r} holds {len(refs)} image(s) (data.image_placeholder)"
        )


def prompt_texts(prompt: Any) -> list[str]:
    """The texts of a prompt value that can hold placeholders (a string, or messages' contents)."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list):
        return [m.get("content") or "" for m in prompt if isinstance(m, dict)]
    return []


def check_images_of_first_row(path: str, cfg: Any) -> None:
    """DataError naming `path`'s row 0 and the key when its images do not decode or its
    placeholders do not count them (later rows are checked as they load, each a bad row)."""
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(path)
    names = list(parquet.schema_arrow.names)
    if check_image_column(path, parquet.schema_arrow, cfg) is None or parquet.metadata.num_rows == 0:
        return
    columns = list(dict.fromkeys([column_of(cfg.image_key, names), column_of(cfg.prompt_key, names)]))
    record = parquet.read_row_group(0, columns=columns).slice(0, 1).to_pylist()[0]
    try:
        refs = image_refs(value_at(record, cfg.image_key), Path(path).parent)
        check_row_images(refs, prompt_texts(value_at(record, cfg.prompt_key)), cfg)
    except ValueError as err:
        raise DataError(f"{path}:0: {err}") from None


@dataclass
class RuntimeImages:
    """Decodes a prompt's images where they are used; a failure is logged with the prompt's
    source, counted in `bad` and answered with None (the caller drops that prompt), never raised."""

    bad: list[tuple[str, str]] = field(default_factory=list)  # (source, reason)

    @property
    def num_bad(self) -> int:
        return len(self.bad)

    def load(self, item: Any) -> list[Any] | None:
        images = []
        for i, ref in enumerate(item.images):
            try:
                images.append(decode_image(ref))
            except ValueError as err:
                reason = f"image {i}: {err}"
                self.bad.append((item.source, reason))
                if self.num_bad <= _MAX_LOGGED:
                    logger.warning("dropping prompt %s: %s", item.source, reason)
                return None
        return images

    def metrics(self) -> dict[str, float]:
        return {"data/bad_images": float(self.num_bad)}
