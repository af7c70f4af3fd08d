"""StopRules: when a sample ends, decided in one place (no jax).

After every new output token the Scheduler's `postprocess` asks `verdict(req, token)`:
"stop" on an EOS token (unless ignore_eos), one of the request's stop token ids or a stop
string (engine/base/stop_strings.py), with what matched; "length" at max_new_tokens or the
context length; else None. `ban_ids(req)` says which tokens the sampler must not draw
yet (min_new_tokens).

Invariant: a verdict only reads; the caller (the Scheduler) records it on the Req.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from multiserve.engine.sched.request import Req
from multiserve.types import FinishReason

# (output ids, stop strings) -> the stop string the output ends on now, or None
StopStringCheck = Callable[[Sequence[int], Sequence[str]], str | None]


@dataclass(frozen=True)
class StopRules:
    eos_ids: frozenset[int]
    max_context: int
    stop_strings: StopStringCheck | None = None

    def verdict(self, req: Req, tok: int) -> tuple[FinishReason | None, int | str | None]:
        """(finish reason or None, matched stop token / string or None) after `tok`, the
        newest of `req.output_ids`."""
        p = req.params
        if not p.ignore_eos and tok in self.eos_ids:
            return "stop", tok
        if tok in p.stop_token_ids:
            return "stop", tok
        if p.stop and self.stop_strings is not None:
            matched = self.stop_strings(req.output_ids, p.stop)
            if matched is not None:
                return "stop", matched
        if len(req.output_ids) >= p.max_new_tokens:
            return "length", None
        if len(req.prompt_ids) + len(req.output_ids) >= self.max_context:
            return "length", None
        return None, None

    def ban_ids(self, req: Req, ahead: int = 0) -> tuple[int, ...]:
        """Token ids the next sample of `req` may not be (EOS and stop ids before
        min_new_tokens), sorted; `ahead`: the sample that many tokens later (a verify
        row's draft positions)."""
        if req.num_generated + ahead >= req.params.min_new_tokens:
            return ()
        return tuple(sorted(self.eos_ids | set(req.params.stop_token_ids)))
