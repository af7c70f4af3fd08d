"""What the scheduler is told of the compiled step programs (`CompiledSizes`): enough to
decide, without the device layer, whether a decode step runs K decode steps in one
dispatch (engine/sched/decode_rows.py `_decode_steps`). EngineCore hands it a new one,
from the runner (engine/device/runner.py `compiled_sizes`), before each schedule while
EngineConfig.decode_steps_per_dispatch K > 1. Plain data (never imports jax)."""

from __future__ import annotations

from dataclasses import dataclass

from multiserve.engine.base.buckets import smallest_fit


@dataclass(frozen=True)
class CompiledSizes:
    """The sizes of the step programs a step may run now: the forward's token buckets and
    the head's row buckets a step picks from (the primed ones once warm-up began, every
    configured one while warm-up is off), and the fused sizes with a primed DECODE_STEPS
    program (none in an engine spanning hosts, whose followers replay single steps, nor
    with routing replay). The default: no program, no K decode steps."""

    forward: tuple[int, ...] = ()
    head: tuple[int, ...] = ()
    decode_steps: tuple[int, ...] = ()

    def runs_decode_steps(self, num_rows: int) -> bool:
        """Whether a decode-only step of `num_rows` rows can run K decode steps in one
        dispatch: the buckets it pads to (the smallest forward and head buckets that hold
        it) are one size b, and b has a DECODE_STEPS program."""
        if not self.decode_steps:
            return False
        t = smallest_fit(self.forward, num_rows)
        return (t is not None and t == smallest_fit(self.head, num_rows)
                and t in self.decode_steps)
