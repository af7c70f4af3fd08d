"""PauseState: why an engine is paused, as a set of reasons (no jax).

Reasons are types.PAUSE_REASONS. "user" is the user's pause (`pause_generation` /
`continue_generation`); every other reason is a hold of the subsystem that set it
(weight staging: "weights_staged", memory release: "memory_released").

Invariants:
- The engine is paused iff the set is non-empty; while it is, no step runs.
- "user" is added and removed only by `set_user` / `clear_user`; any other reason only by
  `add_hold` / `remove_hold`, by its owner. No hold's end clears the user's pause, and
  the user's resume clears no hold.
- Only the engine thread reads or changes it (EngineCore owns one).
"""

from __future__ import annotations

from multiserve.types import PauseReason


class PauseState:
    def __init__(self) -> None:
        self._reasons: set[PauseReason] = set()

    @property
    def paused(self) -> bool:
        return bool(self._reasons)

    @property
    def reasons(self) -> list[PauseReason]:
        """The reasons, sorted."""
        return sorted(self._reasons)

    @property
    def user(self) -> bool:
        """The user's pause is set."""
        return "user" in self._reasons

    def set_user(self) -> None:
        self._reasons.add("user")

    def clear_user(self) -> bool:
        """Clear the user's pause; True iff it was set."""
        had = self.user
        self._reasons.discard("user")
        return had

    def add_hold(self, reason: PauseReason) -> None:
        assert reason != "user", "the user's pause is set_user()/clear_user()"
        self._reasons.add(reason)

    def remove_hold(self, reason: PauseReason) -> bool:
        """End hold `reason`. True iff it was set and no reason is left: the engine runs
        again now."""
        assert reason != "user", "the user's pause is set_user()/clear_user()"
        if reason not in self._reasons:
            return False
        self._reasons.discard(reason)
        return not self._reasons
