"""Multi-turn rollouts: an agent drives each sample (`rollout.agent`).

Two kinds (`rl3d.agents.kinds`), one interface (`rl3d.agents.base.Agent`: a share of prompts in,
training rows out). `ToolLoopAgent` (`kind: tool_loop`) is rl3d's tool loop at the token level
(`rl3d.agents.tool_loop`). `EndpointAgent` (`kind: endpoint`) runs a user's `run(client, sample)`
per sample against `AgentServer`, an OpenAI-compatible endpoint over the rollout engine that
records every completion's token ids and log-probs by session (`rl3d.agents.sessions`), and
turns the sessions into training rows. Chat messages go through the model's chat template
(`rl3d.agents.chat`); tool-call text comes back as OpenAI `tool_calls` (`rl3d.agents.tool_calls`).
"""

from rl3d.agents.base import Agent, AgentRow
from rl3d.agents.chat import ChatFormat
from rl3d.agents.kinds import AGENT_KINDS, build_agent
from rl3d.agents.rollout import AgentOutcome, EndpointAgent, agent_reward
from rl3d.agents.server import AgentServer
from rl3d.agents.sessions import Completion, SessionLog, TrainingSequence, training_sequences
from rl3d.agents.tool_calls import parse_tool_calls
from rl3d.agents.tool_loop import ToolLoop, ToolLoopAgent, ToolLoopConfig

__all__ = [
    "AGENT_KINDS",
    "Agent",
    "AgentOutcome",
    "AgentRow",
    "AgentServer",
    "ChatFormat",
    "Completion",
    "EndpointAgent",
    "SessionLog",
    "ToolLoop",
    "ToolLoopAgent",
    "ToolLoopConfig",
    "TrainingSequence",
    "agent_reward",
    "build_agent",
    "parse_tool_calls",
    "training_sequences",
]
