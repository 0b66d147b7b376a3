"""`PromptSampler`: the prompts of each RL step, epoch after epoch, resumable exactly.

Epoch `e` visits the dataset in the order ``randperm(len, seed=hash(seed, e))`` (identity order
without shuffle). A step takes the next `prompts_per_step` prompts; a step that crosses the end
of an epoch finishes it and continues in the next epoch's order, so every prompt is used once
per epoch and none is dropped. The position is just (epoch, offset): `state_dict()` stores it
and a sampler loaded with it yields exactly the batches the saved one would have yielded.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch

from rl3d.data.dataset import PromptItem

_EPOCH_SEED_STRIDE = 1_000_003  # a prime, so (seed, epoch) pairs map to distinct generator seeds


class PromptSampler:
    def __init__(self, dataset: Sequence[PromptItem], *, prompts_per_step: int, seed: int, shuffle: bool):
        if len(dataset) == 0:
            raise ValueError("PromptSampler: the dataset is empty")
        if prompts_per_step <= 0:
            raise ValueError(f"PromptSampler: prompts_per_step must be > 0, got {prompts_per_step}")
        self.dataset = dataset
        self.prompts_per_step = prompts_per_step
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.offset = 0  # prompts of the current epoch already yielded
        self._order: list[int] | None = None  # the current epoch's order, made lazily

    @property
    def steps_per_epoch(self) -> float:
        return len(self.dataset) / self.prompts_per_step

    def epoch_order(self, epoch: int) -> list[int]:
        """Dataset indices in the order epoch `epoch` visits them."""
        n = len(self.dataset)
        if not self.shuffle:
            return list(range(n))
        gen = torch.Generator().manual_seed(self.seed * _EPOCH_SEED_STRIDE + epoch)
        return torch.randperm(n, generator=gen).tolist()

    def next_batch(self) -> list[PromptItem]:
        batch: list[PromptItem] = []
        while len(batch) < self.prompts_per_step:
            if self._order is None:
                self._order = self.epoch_order(self.epoch)
            take = min(self.prompts_per_step - len(batch), len(self._order) - self.offset)
            batch.extend(self.dataset[i] for i in self._order[self.offset : self.offset + take])
            self.offset += take
            if self.offset == len(self._order):
                self.epoch, self.offset, self._order = self.epoch + 1, 0, None
        return batch

    def __iter__(self) -> Iterator[list[PromptItem]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "offset": self.offset,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_items": len(self.dataset),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at `state`'s position; the dataset, seed and shuffle must match the saved run.

        `prompts_per_step` may differ: the position counts prompts, not steps.
        """
        for key, mine in (("num_items", len(self.dataset)), ("seed", self.seed), ("shuffle", self.shuffle)):
            if state[key] != mine:
                raise ValueError(
                    f"PromptSampler: cannot resume, the checkpoint's {key} is {state[key]!r} but this "
                    f"run's is {mine!r} (did the data or the seed change?)"
                )
        if not 0 <= state["offset"] < len(self.dataset) or state["epoch"] < 0:
            raise ValueError(
                f"PromptSampler: invalid position epoch={state['epoch']} offset={state['offset']}"
            )
        self.epoch, self.offset, self._order = int(state["epoch"]), int(state["offset"]), None
