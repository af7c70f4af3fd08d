"""A rollout client for RL trainers over multiserve (in-process Engines or the fleet's HTTP
ports): generate, update weights fleet-wide, pause/resume, release/resume memory.
Uses only multiserve's public API. See client.py and sops/rl-weight-sync.md.
`AgentLoop` (agent_loop.py): multi-turn tool-using rollouts over `/generate`."""

from plugins.rollout.agent_loop import AgentLoop, AgentTurn, Trajectory
from plugins.rollout.chat_turns import ChatTurns
from plugins.rollout.client import RolloutClient
from plugins.rollout.results import RolloutError, RolloutHandle, RolloutResult

__all__ = ["AgentLoop", "AgentTurn", "ChatTurns", "RolloutClient", "RolloutError",
           "RolloutHandle", "RolloutResult", "Trajectory"]
