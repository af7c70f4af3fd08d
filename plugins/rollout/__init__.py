"""A rollout client for RL trainers over multiserve (in-process Engines or the fleet's HTTP
ports): generate, update weights fleet-wide, pause/resume, release/resume memory.
Uses only multiserve's public API. See client.py and sops/rl-weight-sync.md."""

from plugins.rollout.client import RolloutClient
from plugins.rollout.results import RolloutError, RolloutHandle, RolloutResult

__all__ = ["RolloutClient", "RolloutError", "RolloutHandle", "RolloutResult"]
