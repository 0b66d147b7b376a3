"""A synthetic task solvable only with a tool: multiply two numbers with the calculator.

The prompt is ``"{a}*{b}="`` (two 4-digit numbers). A tiny random model cannot multiply; it
can learn to call the calculator and copy the result. The ideal trajectory, as text:

    prompt:      4213*7789=
    turn 1:      <tool_call>{"name": "calculator", "arguments": {"expression": "4213*7789"}}</tool_call>
    observation: <result>32815057</result>
    turn 2:      32815057 EOS

`ToolTokenizer` makes that short: the call's head and tail (`CALL`, `CALL_END`) and the
observation tags are single tokens, every other token one character, so the ideal response is
``CALL a a a a * b b b b CALL_END | OBS p.. OBS_END | p.. EOS`` (about 30 tokens) over a
32-id vocabulary (`tiny-llama-v32`). Characters outside it (letters of an error message) encode
as ``?``. The reward (`rl3d.rewards.tool_task.tool_multiply_reward`) gives partial credit for
the call, its operands and the answer's digits, so a random policy already earns a varying one.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from rl3d.data.task import SYNTHETIC_TASKS, SyntheticTask
from rl3d.data.tokenizer import EOS_ID, PAD_ID
from rl3d.tools.calculator import CalculatorError, evaluate

CALL_TEXT = '<tool_call>{"name": "calculator", "arguments": {"expression": "'
CALL_END_TEXT = '"}}</tool_call>'
OBS_TEXT, OBS_END_TEXT = "<result>", "</result>"
CALL_ID, CALL_END_ID, OBS_ID, OBS_END_ID = 2, 3, 4, 5
_CHARS = "*=0123456789 +-()/%.?[]"  # ids 6.. ; "?" stands for any other character
_SPECIAL_TEXT = {CALL_ID: CALL_TEXT, CALL_END_ID: CALL_END_TEXT, OBS_ID: OBS_TEXT, OBS_END_ID: OBS_END_TEXT}
TOOL_VOCAB_SIZE = 6 + len(_CHARS)


class ToolTokenizer:
    """Id <-> text for the tool task: specials as whole tags, the rest one character each.

    ``decode`` drops PAD and EOS; ``encode`` matches the longest special first and writes any
    character it lacks as ``?`` (so an observation always encodes)."""

    pad_token_id, eos_token_id, bos_token_id = PAD_ID, EOS_ID, None

    def __init__(self, vocab_size: int = TOOL_VOCAB_SIZE):
        if vocab_size < TOOL_VOCAB_SIZE:
            raise ValueError(f"ToolTokenizer needs vocab_size >= {TOOL_VOCAB_SIZE}, got {vocab_size}")
        self.vocab_size = vocab_size
        self.text = {**_SPECIAL_TEXT, **{6 + i: c for i, c in enumerate(_CHARS)}}
        self.char_id = {c: 6 + i for i, c in enumerate(_CHARS)}
        self.specials = sorted(_SPECIAL_TEXT.items(), key=lambda kv: -len(kv[1]))

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids, i = [], 0
        while i < len(text):
            for token, tag in self.specials:
                if text.startswith(tag, i):
                    ids.append(token)
                    i += len(tag)
                    break
            else:
                ids.append(self.char_id.get(text[i], self.char_id["?"]))
                i += 1
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        out = []
        for token in ids:
            token = int(token)
            if not 0 <= token < self.vocab_size:
                raise ValueError(f"ToolTokenizer: id {token} outside the vocabulary [0, {self.vocab_size})")
            out.append(self.text.get(token, ""))  # PAD, EOS and ids past the table are empty
        return "".join(out)

    def batch_decode(self, batch: Iterable[Iterable[int]], skip_special_tokens: bool = False) -> list[str]:
        return [self.decode(ids) for ids in batch]

    def __repr__(self) -> str:
        return f"ToolTokenizer(vocab_size={self.vocab_size})"


def _no_credit(first: int, token: int) -> float:
    raise AssertionError("tool tasks score whole responses (score), not tokens")


@dataclass(frozen=True)
class ToolMultiplyTask(SyntheticTask):
    """Prompts ``"{a}*{b}="`` with `digits`-digit operands (as `ToolTokenizer` ids)."""

    digits: int = 4

    def operands(self, prompt_ids: Sequence[int]) -> tuple[int, int]:
        text = ToolTokenizer().decode(prompt_ids)
        a, b = text.rstrip("=").split("*")
        return int(a), int(b)

    def make_prompts(self, num_prompts: int, seed: int) -> list[list[int]]:
        rng = random.Random(f"rl3d.synthetic:{self.name}:{seed}")
        lo, hi = 10 ** (self.digits - 1), 10**self.digits - 1
        tok = ToolTokenizer()
        return [tok.encode(f"{rng.randint(lo, hi)}*{rng.randint(lo, hi)}=") for _ in range(num_prompts)]

    def answer(self, prompt_ids: Sequence[int]) -> int:
        a, b = self.operands(prompt_ids)
        return a * b

    def score(
        self, prompt_ids: Sequence[int], response_ids: Sequence[int], finish_reason: str | None
    ) -> float:
        """From the response's text alone (the trajectory-aware reward is
        `rl3d.rewards.tool_task.tool_multiply_reward`; both give the same score)."""
        a, b = self.operands(prompt_ids)
        return score_turns(a, b, turns_from_text(ToolTokenizer().decode(response_ids)))


def turns_from_text(text: str) -> list[tuple[str, str | None]]:
    """(turn text, observation or None) per turn, split at the observation tags."""
    turns: list[tuple[str, str | None]] = []
    while OBS_TEXT in text:
        head, _, rest = text.partition(OBS_TEXT)
        observation, _, text = rest.partition(OBS_END_TEXT)
        turns.append((head, observation))
    turns.append((text, None))
    return turns


def call_expression(turn_text: str) -> str | None:
    """The calculator expression of the call in `turn_text`, or None when there is none."""
    start = turn_text.find(CALL_TEXT)
    end = turn_text.find(CALL_END_TEXT, start + len(CALL_TEXT))
    return None if start < 0 or end < 0 else turn_text[start + len(CALL_TEXT) : end]


def _match(text: str, gold: str) -> float:
    """Characters equal position by position, over the longer of the two."""
    return sum(x == y for x, y in zip(text, gold)) / max(len(text), len(gold))


CREDIT_CALL, CREDIT_VALID, CREDIT_OPERANDS, CREDIT_ANSWER = 0.1, 0.1, 0.3, 0.5


def score_turns(a: int, b: int, turns: Sequence[tuple[str, str | None]]) -> float:
    """The reward of a trajectory for ``a*b``, in [0, 1]: when its first turn calls the calculator,
    0.1, plus 0.1 when the expression is valid arithmetic, plus 0.3 times how much of it equals
    ``"a*b"`` (characters in place); and 0.5 times how much of the final answer (the last turn,
    when it makes no call) equals the product. Only the exact product earns the whole 0.5: the
    tool's result, copied."""
    expression = call_expression(turns[0][0]) if turns else None
    score = 0.0
    if expression is not None:
        try:
            evaluate(expression, max_digits=40)
            valid = True
        except CalculatorError:
            valid = False
        score += CREDIT_CALL + CREDIT_VALID * valid + CREDIT_OPERANDS * _match(expression.strip(), f"{a}*{b}")
    last = turns[-1][0] if turns else ""
    answer = last.strip()
    if answer and CALL_TEXT not in last and CALL_END_TEXT not in last:
        score += CREDIT_ANSWER * _match(answer, str(a * b))
    return score


def tool_multiply_demonstrations(
    num_examples: int = 32,
    seed: int = 0,
    *,
    digits: int = 4,
    max_observation_tokens: int = 16,
    observation_tags: tuple[str, str] = (OBS_TEXT, OBS_END_TEXT),
) -> list[dict]:
    """Ideal `tool_multiply` trajectories for a warm start (`actor.warm_start.data`): the call
    with the prompt's operands, the calculator's observation, the product copied, EOS.

    The call is parsed (`rl3d.tools.ToolCallParser`) and run through the real calculator
    (`rl3d.tools.ToolBox`), and the observation is tokenized, cut to `max_observation_tokens` and
    wrapped in the tags as the tool loop does (`rl3d.agents.tool_loop`), so a demonstration
    is a trajectory the loop itself produces for this policy. Rows (`rl3d.controller.warm_start`):
    ``{"prompt_ids", "segments": [call (loss), observation (no loss), answer + EOS (loss)]}``.
    Prompts come from their own seed stream, not the RL prompts' (`make_prompts`)."""
    from rl3d.tools import ToolBox, ToolCall, ToolCallParser
    from rl3d.tools.calculator import Calculator

    tok, tools = ToolTokenizer(), ToolBox([Calculator()])
    parser = ToolCallParser(open_tag="<tool_call>", close_tag="</tool_call>")
    rng = random.Random(f"rl3d.demonstrations:tool_multiply:{digits}:{seed}")
    lo, hi = 10 ** (digits - 1), 10**digits - 1
    rows = []
    for _ in range(num_examples):
        a, b = rng.randint(lo, hi), rng.randint(lo, hi)
        call_text = f"{CALL_TEXT}{a}*{b}{CALL_END_TEXT}"
        call = parser.parse(call_text)
        assert isinstance(call, ToolCall), call
        result = tools.call(call.name, call.arguments)
        assert result.ok, result.error
        body = tok.encode(result.observation())[:max_observation_tokens]
        observation = tok.encode(observation_tags[0]) + body + tok.encode(observation_tags[1])
        answer = tok.encode(result.text.strip()) + [EOS_ID]
        segments = [
            {"ids": tok.encode(call_text), "loss": True},
            {"ids": observation, "loss": False},
            {"ids": answer, "loss": True},
        ]
        rows.append({"prompt_ids": tok.encode(f"{a}*{b}="), "segments": segments})
    return rows


# Registered without `register_synthetic_task`'s check that symbols start at SYMBOL_BASE: this
# vocabulary is its own (`ToolTokenizer`), whose specials are PAD 0 and EOS 1, as there.
TOOL_MULTIPLY = ToolMultiplyTask(
    name="tool_multiply",
    alphabet=tuple(range(6, TOOL_VOCAB_SIZE)),
    prompt_length=10,
    credit=_no_credit,
    description="multiply two 4-digit numbers: call the calculator, copy its result",
)
SYNTHETIC_TASKS.register(TOOL_MULTIPLY.name, TOOL_MULTIPLY)
