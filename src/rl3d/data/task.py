"""What a synthetic task is (`SyntheticTask`: a prompt generator plus its reward) and the registry
of tasks by name. The tasks themselves are defined in `rl3d.data.synthetic` and
`rl3d.data.tool_task`; import `rl3d.data` to have them all registered."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rl3d.data.tokenizer import SYMBOL_BASE
from rl3d.utils.registry import Registry

FINISH_STOP = "stop"  # same string as rl3d.rollout.base.FINISH_STOP (not imported: no torch here)


def response_content(response_ids: Sequence[int], finish_reason: str | None) -> list[int]:
    """The tokens a synthetic reward scores: the response without its final stop token."""
    ids = [int(t) for t in response_ids]
    return ids[:-1] if finish_reason == FINISH_STOP and ids else ids


@dataclass(frozen=True)
class SyntheticTask:
    """A prompt generator plus its reward.

    `credit(first_token, token) -> float in [0, 1]` scores one response token; the task's reward
    is the mean credit over the response content (see `rl3d.data.synthetic`).
    """

    name: str
    alphabet: tuple[int, ...]
    prompt_length: int
    credit: Callable[[int, int], float]
    repeat: bool = False  # True: a prompt is one symbol repeated; False: independent symbols
    description: str = ""

    @property
    def min_vocab_size(self) -> int:
        return max(self.alphabet) + 1

    def make_prompts(self, num_prompts: int, seed: int) -> list[list[int]]:
        """`num_prompts` prompts, the same for the same (task, seed) on every machine."""
        rng = random.Random(f"rl3d.synthetic:{self.name}:{seed}")
        k = len(self.alphabet)
        if self.repeat:
            return [[self.alphabet[rng.randrange(k)]] * self.prompt_length for _ in range(num_prompts)]
        return [
            [self.alphabet[rng.randrange(k)] for _ in range(self.prompt_length)] for _ in range(num_prompts)
        ]

    def answer(self, prompt_ids: Sequence[int]) -> int:
        """The target symbol: the prompt's first token (kept in `PromptItem.answer` for logs)."""
        return int(prompt_ids[0])

    def score(
        self, prompt_ids: Sequence[int], response_ids: Sequence[int], finish_reason: str | None
    ) -> float:
        if not prompt_ids:
            raise ValueError(f"synthetic task {self.name!r}: empty prompt")
        content = response_content(response_ids, finish_reason)
        if not content:
            return 0.0
        first = int(prompt_ids[0])
        return sum(self.credit(first, t) for t in content) / len(content)


SYNTHETIC_TASKS: Registry[SyntheticTask] = Registry("synthetic task")


def register_synthetic_task(task: SyntheticTask) -> SyntheticTask:
    assert min(task.alphabet) >= SYMBOL_BASE, "prompt symbols must not collide with special ids"
    SYNTHETIC_TASKS.register(task.name, task)
    return task


def get_synthetic_task(name: str) -> SyntheticTask:
    return SYNTHETIC_TASKS.get(name)
