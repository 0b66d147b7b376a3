"""Prompts as the batch the rollout takes (the trainer's steps and validation alike)."""

from __future__ import annotations

from rl3d.data.images import IMAGES
from rl3d.single_controller.batch import PROMPT_WIDTH, DataBatch


def prompt_batch(items) -> DataBatch:
    """`PromptItem`s as the DataBatch `generate_sequences` takes. Rows with images
    (`data.image_key`) carry them, still encoded, in `images` (each row's tuple; absent when no
    row has one), so they travel with their rows wherever the batch is dealt."""
    batch = DataBatch(
        meta={
            "prompt_ids": [list(i.prompt_ids) for i in items],
            "prompt_text": [i.prompt_text for i in items],
            "answer": [i.answer for i in items],
            "source": [i.source for i in items],
            "data_source": [i.data_source for i in items],  # data.source_key's column, or None
            "index": [i.index for i in items],
            "messages": [i.messages for i in items],  # a chat row's messages, else None
        },
        info={PROMPT_WIDTH: max(len(i.prompt_ids) for i in items)},
    )
    if any(getattr(i, "images", ()) for i in items):
        batch.set(IMAGES, [tuple(i.images) for i in items])
    return batch
