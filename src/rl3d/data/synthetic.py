"""Synthetic tasks: prompts generated from a seed, with an exactly checkable reward.

They exist so that the whole RL loop can be shown to *learn* on a tiny random model on CPU,
with no data and no tokenizer files. A task's prompts are token-id lists over a small alphabet
(ids from `SYMBOL_BASE`, see `rl3d.data.tokenizer`), and its reward depends only on the prompt
and response ids. The untrained policy must already earn a dense, varying reward so that GRPO
has a signal from step one; the optimum is 1.0. A recipe picks one with
`data.synthetic: {task: parity_repeat, num_prompts: 512, seed: 0}` (no data files needed).

How responses are scored (every task): the response's *content* is its token ids minus the last
one when `finish_reason == "stop"` (the rollout engine keeps the stop token). An empty content
scores 0.0. The reward is the mean of a per-token credit over the content, so it is in [0, 1].

Tasks (`f` is the prompt's first token, `t` a content token). Each reward comes with two prompt
kinds: *random* prompts (8 tokens drawn independently from the alphabet) and *repeat* prompts
(one symbol drawn from the alphabet, written 8 times, so the first token is every token):

- ``parity_match`` (random) / ``parity_repeat`` (repeat): 16 symbols (ids 16..31, half even,
  half odd). credit(t) = 1 if t % 2 == f % 2 else 0. A uniformly random policy over a
  vocabulary of even size scores exactly 0.5 in expectation, any policy that ignores the prompt
  scores 0.5 too, and conditioning on one bit of the first token reaches 1.0.
- ``copy_first`` (random) / ``copy_repeat`` (repeat): 8 symbols (ids 16..23; 16 is a multiple
  of 8, so the symbol is the id's low 3 bits). credit(t) = 0.5 * [t == f] + 0.5 * (number of the
  3 low bits that t and f share) / 3. The second term is the partial credit that makes exact
  copying learnable: a random policy over 256 ids scores 0.5/256 + 0.25 ~= 0.252, a constant
  policy at most 0.3125, matching the low bits 0.5, and copying the first token exactly 1.0.

On the demo's settings the *repeat* tasks' reward rises within tens of steps and the *random* ones are
the harder benchmarks; ``parity_repeat`` is the demo's task. The measured curves, their seed
sweeps and the commands that made them are in docs/demo.md.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rl3d.data.tokenizer import SYMBOL_BASE
from rl3d.utils.imports import suggest

FINISH_STOP = "stop"  # same string as rl3d.rollout.base.FINISH_STOP (not imported: no torch here)


def response_content(response_ids: Sequence[int], finish_reason: str | None) -> list[int]:
    """The tokens a synthetic reward scores: the response without its final stop token."""
    ids = [int(t) for t in response_ids]
    return ids[:-1] if finish_reason == FINISH_STOP and ids else ids


@dataclass(frozen=True)
class SyntheticTask:
    """A prompt generator plus its reward.

    `credit(first_token, token) -> float in [0, 1]` scores one response token; the task's reward
    is the mean credit over the response content (see the module docstring).
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


def _parity_credit(first: int, token: int) -> float:
    return 1.0 if token % 2 == first % 2 else 0.0


_COPY_BITS = 3  # copy_first's alphabet has 2**3 symbols


def _copy_credit(first: int, token: int) -> float:
    mask = (1 << _COPY_BITS) - 1
    shared_low_bits = _COPY_BITS - bin((first ^ token) & mask).count("1")
    return 0.5 * (token == first) + 0.5 * shared_low_bits / _COPY_BITS


SYNTHETIC_TASKS: dict[str, SyntheticTask] = {}


def register_synthetic_task(task: SyntheticTask) -> SyntheticTask:
    assert task.name not in SYNTHETIC_TASKS, f"synthetic task {task.name!r} registered twice"
    assert min(task.alphabet) >= SYMBOL_BASE, "prompt symbols must not collide with special ids"
    SYNTHETIC_TASKS[task.name] = task
    return task


assert SYMBOL_BASE % (1 << _COPY_BITS) == 0, "copy_first's symbol index is the id's low bits"
_PARITY_ALPHABET = tuple(range(SYMBOL_BASE, SYMBOL_BASE + 16))
_COPY_ALPHABET = tuple(range(SYMBOL_BASE, SYMBOL_BASE + (1 << _COPY_BITS)))

for _repeat, _suffix in ((False, ""), (True, " (prompt: one symbol repeated)")):
    register_synthetic_task(
        SyntheticTask(
            name="parity_repeat" if _repeat else "parity_match",
            alphabet=_PARITY_ALPHABET,
            prompt_length=8,
            credit=_parity_credit,
            repeat=_repeat,
            description="answer with tokens of the first prompt token's parity" + _suffix,
        )
    )
    register_synthetic_task(
        SyntheticTask(
            name="copy_repeat" if _repeat else "copy_first",
            alphabet=_COPY_ALPHABET,
            prompt_length=8,
            credit=_copy_credit,
            repeat=_repeat,
            description="repeat the first prompt token, low-bit partial credit" + _suffix,
        )
    )


def get_synthetic_task(name: str) -> SyntheticTask:
    if name not in SYNTHETIC_TASKS:
        known = sorted(SYNTHETIC_TASKS)
        raise ValueError(f"unknown synthetic task {name!r}{suggest(name, known)}; known: {', '.join(known)}")
    return SYNTHETIC_TASKS[name]


from rl3d.data import tool_task as _tool_task  # noqa: E402,F401  registers tool_multiply
