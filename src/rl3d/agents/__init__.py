"""Agents from any framework: an OpenAI-compatible endpoint over the rollout engine.

`AgentServer` serves the policy to agent programs over HTTP during a rollout and records every
completion's token ids and log-probs by session (`rl3d.agents.sessions`); `AgentRollout` runs a
user's `run(client, sample)` per sample against it (`rollout.agent`) and turns the sessions into
training rows. Chat messages go through the model's chat template (`rl3d.agents.chat`); tool-call
text comes back as OpenAI `tool_calls` (`rl3d.agents.tool_calls`).
"""

from rl3d.agents.chat import ChatFormat
from rl3d.agents.rollout import AgentOutcome, AgentRollout, agent_reward
from rl3d.agents.server import AgentServer
from rl3d.agents.sessions import Completion, SessionLog, TrainingSequence, training_sequences
from rl3d.agents.tool_calls import parse_tool_calls

__all__ = [
    "AgentOutcome",
    "AgentRollout",
    "agent_reward",
    "AgentServer",
    "ChatFormat",
    "Completion",
    "SessionLog",
    "TrainingSequence",
    "parse_tool_calls",
    "training_sequences",
]
