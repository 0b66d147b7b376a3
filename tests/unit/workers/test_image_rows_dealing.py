"""Images travel with their rows: a prompt batch with an `images` column (`prompt_batch`) dealt
round-robin to generation-DP ranks, each rank's prompts turned into n response rows
(`rows_to_batch`, as `Generation` does), and the ranks' rows collected back in input order: every
row holds its own prompt's images, the same object for its n samples (no copy)."""

import torch

from rl3d.controller.prompts import prompt_batch
from rl3d.data.dataset import PromptItem
from rl3d.single_controller.dispatch import MODES, Dispatch, Slot
from rl3d.workers.generation import rows_to_batch


def _items():
    images = [(b"png-a",), (), (b"png-b", "/data/c.png"), (b"png-d",), (b"png-e",)]
    return [
        PromptItem(i, [1, 2 + i], f"p{i}", None, f"f.parquet:{i}", None, None, refs)
        for i, refs in enumerate(images)
    ]


def test_images_follow_their_rows_through_dealing_and_collecting():
    items = _items()
    prompts = prompt_batch(items).set("uid", torch.arange(100, 105))
    mode, n, ranks = MODES[Dispatch.GENERATION_COMPUTE], 3, 2
    parts = []
    for rank in range(ranks):
        slot = Slot(rank, ranks, True)
        share = mode.split(prompts, slot)
        assert share["images"] == [tuple(items[i].images) for i in range(rank, len(items), ranks)]
        rows = [(p, [7, 8], [0.0, 0.0], "length") for p in range(len(share)) for _ in range(n)]
        parts.append((slot, rows_to_batch(share, rows, pad_token_id=0)))
    batch = mode.collect(parts, "mean", prompts)
    assert batch["uid"].tolist() == [100 + i for i in range(len(items)) for _ in range(n)]
    assert batch["images"] == [tuple(items[i].images) for i in range(len(items)) for _ in range(n)]
    first = batch["images"][:n]
    assert all(x is first[0] for x in first)  # a prompt's samples share its images


def test_a_text_only_batch_has_no_images_column():
    items = [PromptItem(0, [1, 2], "p", None, "f:0", None, None)]
    assert "images" not in prompt_batch(items)
