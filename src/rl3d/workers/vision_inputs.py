"""A rollout batch's images as a vision-language engine takes them.

The rows carry their images encoded (`rl3d.controller.prompts.prompt_batch`'s `images`
column); here each prompt's are decoded (`rl3d.data.images.RuntimeImages`) and turned into the
vision tower's pixels (`rl3d.models.llava.llava_pixel_values`, the model directory's image
processor), once per prompt: its n samples share them, and the engine encodes them once.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from rl3d.data.images import IMAGES
from rl3d.single_controller.batch import DataBatch


def image_pixels(
    engine: Any, runtime: Any, prompts: DataBatch, hf_dir: str | None
) -> tuple[list[int], list[torch.Tensor | None]]:
    """(the prompt rows kept, their pixels): a row whose image no longer decodes is left out
    (`runtime` logs and counts it); a text-only row's pixels are None."""
    spec = getattr(engine, "llava", None)
    if spec is None:
        raise ValueError(
            f"rollout engine {getattr(engine, 'name', type(engine).__name__)!r}: the prompts carry "
            "images (data.image_key) but the engine runs no vision tower (rl3d.rollout.vision)"
        )
    from rl3d.models.llava import llava_pixel_values

    kept, pixels = [], []
    sources = prompts.meta.get("source") or [f"row {i}" for i in range(len(prompts))]
    for i, (refs, source) in enumerate(zip(prompts[IMAGES], sources, strict=True)):
        if not refs:
            kept.append(i)
            pixels.append(None)
            continue
        images = runtime.load(SimpleNamespace(images=refs, source=source))
        if images is None:
            continue
        kept.append(i)
        pixels.append(llava_pixel_values(images, spec, hf_dir))
    return kept, pixels


def row_pixels(batch: DataBatch, spec: Any, runtime: Any, hf_dir: str | None) -> list[torch.Tensor | None]:
    """Each response row's pixels for the trainer's forward (`rl3d.models.llava_logprobs`), from
    the batch's `images` column: a prompt's images decoded and processed once for its n rows
    (they hold the same images), a text-only row's None. The rollout decoded these images, so one
    that no longer does (a file changed since) is an error naming its row and source, not a drop:
    the batch's rows are fixed by now."""
    from rl3d.models.llava import llava_pixel_values

    done: dict[tuple, torch.Tensor] = {}
    out: list[torch.Tensor | None] = []
    sources = batch.meta.get("source") or [f"row {i}" for i in range(len(batch))]
    for i, (refs, source) in enumerate(zip(batch[IMAGES], sources, strict=True)):
        refs = tuple(refs or ())
        if not refs:
            out.append(None)
            continue
        if refs not in done:
            images = runtime.load(SimpleNamespace(images=refs, source=source))
            if images is None:
                raise RuntimeError(f"row {i} ({source}): an image of column {IMAGES!r} no longer decodes")
            done[refs] = llava_pixel_values(images, spec, hf_dir)
        out.append(done[refs])
    return out
