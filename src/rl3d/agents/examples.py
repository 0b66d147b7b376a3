"""An agent written against the official `openai` client, as a user would write it: the
calculator as an OpenAI function tool on the `tool_multiply` task (`rl3d.data.tool_task`).

    rollout:
      agent: {fn: rl3d.agents.examples:calculator_agent, concurrency: 8, timeout_s: 60}
    reward:
      fn: rl3d.agents:agent_reward

It asks for a reply with the tool offered, runs every call it gets on the calculator, sends
each result back as its own `role: tool` message and asks again, up to `MAX_TURNS` replies;
the reward is the task's own score of the turns (`rl3d.data.tool_task.score_turns`). Nothing
in it knows about rl3d's tokens: the endpoint keeps the trajectory token-exact.
"""

from __future__ import annotations

import json
from typing import Any

from rl3d.data.tool_task import CALL_END_TEXT, CALL_TEXT, score_turns
from rl3d.tools.calculator import Calculator

MAX_TURNS = 3
CALCULATOR = Calculator()


def calculator_agent(client: Any, sample: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """`run(client, sample)` for `rollout.agent.fn`: the reward of one multi-turn episode."""
    a, b = (int(x) for x in sample["prompt"].rstrip("=").split("*"))
    messages: list[dict[str, Any]] = [{"role": "user", "content": sample["prompt"]}]
    turns: list[tuple[str, str | None]] = []
    for _ in range(MAX_TURNS):
        reply = (
            client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR.schema()])
            .choices[0]
            .message
        )
        messages.append(reply.model_dump(exclude_none=True))
        if not reply.tool_calls:
            turns.append((reply.content or "", None))
            break
        for k, call in enumerate(reply.tool_calls):  # each call answered by its own tool message
            try:
                arguments = json.loads(call.function.arguments)
                result = CALCULATOR.call(arguments).observation()
                expression = str(arguments.get("expression", ""))
            except (json.JSONDecodeError, KeyError, AttributeError) as err:
                result, expression = f"[error] {err}", ""
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
            said = (reply.content or "") if k == 0 else ""
            turns.append((f"{said}{CALL_TEXT}{expression}{CALL_END_TEXT}", result))
    return score_turns(a, b, turns), {"turns": len(turns)}
