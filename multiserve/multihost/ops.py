"""The device operations of a spanning engine, as the leader streams them to followers.

Every operation that runs on the engine's (global) devices after warm-up is one of
these, applied by `apply_op` to the follower's Runner exactly as the leader's Runner ran
it (device/runner.py calls `Runner.mirror(op)` before running it itself). Host inputs
travel; device state never does (each host holds its own shards).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np


@dataclass(frozen=True)
class RunStep:
    """One step: the forward's packed int32 inputs, the head's packed sampling fields,
    and its three [R, V]-sized arrays (None: the engine's cached device zeros)."""
    tokens: int  # the token bucket T
    num_rows: int  # the row bucket R
    wants_logprobs: bool
    packed_step: np.ndarray
    packed_sampling: np.ndarray
    output_counts: np.ndarray | None
    prompt_mask: np.ndarray | None
    token_mask: np.ndarray | None


@dataclass(frozen=True)
class ResetPrevIds:
    pass


@dataclass(frozen=True)
class DropStepBuffers:
    pass


@dataclass(frozen=True)
class PrimeDeferred:
    pass


@dataclass(frozen=True)
class SetParams:
    """A weight update: the host values of the leaves that change, by path (a tuple of
    keys into the params pytree)."""
    leaves: dict[tuple[str, ...], np.ndarray]


DeviceOp = RunStep | ResetPrevIds | DropStepBuffers | PrimeDeferred | SetParams


class Runner(Protocol):
    """What a follower calls on its runner (engine/device/runner.py's Runner)."""

    def sampling_zeros(self, num_rows: int) -> tuple[Any, Any, Any]: ...

    def run_packed(self, tokens: int, packed: np.ndarray, sampling_args: tuple[Any, ...],
                   wants_logprobs: bool, num_rows: int) -> Any: ...

    def reset_prev_ids(self) -> None: ...

    def drop_step_buffers(self) -> None: ...

    def prime_deferred(self) -> None: ...

    def replace_leaves(self, leaves: dict[tuple[str, ...], np.ndarray]) -> None: ...


def host_or_none(x: Any) -> np.ndarray | None:
    """A sampling array as it travels: host arrays as they are, device zeros as None."""
    return x if isinstance(x, np.ndarray) else None


def apply_op(runner: Runner, op: DeviceOp) -> Any:
    """Run `op` on this host's Runner (the follower's side of `Runner.mirror`)."""
    match op:
        case RunStep():
            arrays = tuple(mine if given is None else given for given, mine in zip(
                (op.output_counts, op.prompt_mask, op.token_mask),
                runner.sampling_zeros(op.num_rows), strict=True))
            return runner.run_packed(op.tokens, op.packed_step,
                                     (op.packed_sampling, *arrays), op.wants_logprobs,
                                     op.num_rows)
        case ResetPrevIds():
            runner.reset_prev_ids()
        case DropStepBuffers():
            runner.drop_step_buffers()
        case PrimeDeferred():
            runner.prime_deferred()
        case SetParams():
            runner.replace_leaves(op.leaves)
    return None
