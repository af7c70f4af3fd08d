"""Latency and throughput figures from per-request token timelines (pure Python).

Owns the arithmetic of the benchmark: percentiles, TTFT (first token time minus the
common submission time), inter-token latency (gap between consecutive tokens of one
request; a snapshot that brings k tokens at once counts as k equal gaps), and the
agreement between two sets of generated ids.
"""

from __future__ import annotations

import resource
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


def peak_rss_mb() -> float:
    """This process's own peak RSS in MiB. /proc's VmHWM belongs to the current address
    space (reset by exec); getrusage's ru_maxrss can report the parent's peak after
    fork+exec, so it is only the fallback."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def without_output_ids(run: dict[str, Any]) -> dict[str, Any]:
    """A run's figures for the JSON line: everything but its output ids."""
    return {k: v for k, v in run.items() if k != "output_ids"}


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]); NaN for no values."""
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


@dataclass
class Timeline:
    """When each output token of one request reached the host (perf_counter seconds)."""

    events: list[tuple[float, int]] = field(default_factory=list)  # (time, tokens so far)
    finished_at: float | None = None
    finish_reason: str | None = None
    output_ids: tuple[int, ...] = ()
    cached_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return self.events[-1][1] if self.events else 0

    def record(self, now: float, num_tokens: int) -> int:
        """Note a snapshot; returns how many new tokens it brought."""
        new = num_tokens - self.num_tokens
        if new > 0:
            self.events.append((now, num_tokens))
        return max(new, 0)

    def ttft(self, t0: float) -> float | None:
        return self.events[0][0] - t0 if self.events else None

    def gaps(self) -> list[float]:
        out: list[float] = []
        for (ta, na), (tb, nb) in zip(self.events, self.events[1:], strict=False):
            k = nb - na
            out.extend([(tb - ta) / k] * k)
        return out


def _wall(timelines: Sequence[Timeline], t0: float) -> float:
    """t0 to the last request's end (NaN if none ended)."""
    ends = [t.finished_at for t in timelines if t.finished_at is not None]
    return (max(ends) - t0) if ends else float("nan")


def summarize(timelines: Sequence[Timeline], t0: float) -> dict[str, float | int]:
    """Throughput and latency figures of one run whose requests were all sent at t0."""
    return summarize_rounds([(timelines, t0)])


def summarize_rounds(rounds: Sequence[tuple[Sequence[Timeline], float]]
                     ) -> dict[str, float | int]:
    """The figures of runs made one after another, each (its timelines, its t0): tokens
    over the summed walls, each TTFT from its own run's t0, the gaps of all."""
    wall = sum(_wall(tls, t0) for tls, t0 in rounds)
    tokens = sum(t.num_tokens for tls, _ in rounds for t in tls)
    ttfts = [x for tls, t0 in rounds for t in tls if (x := t.ttft(t0)) is not None]
    gaps = [g for tls, _ in rounds for t in tls for g in t.gaps()]
    return {
        "output_tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall if wall > 0 else 0.0,  # NaN > 0 is False
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "itl_p50_s": percentile(gaps, 50),
        "itl_p99_s": percentile(gaps, 99),
    }


def agreement(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]) -> dict[str, float]:
    """How far two runs' outputs agree: share of identical outputs and mean common
    prefix length (greedy fp32 engines diverge only where near-ties flip)."""
    assert len(a) == len(b)
    if not a:
        return {"identical_fraction": 1.0, "mean_common_prefix": 0.0}
    same = 0
    prefix_total = 0
    for x, y in zip(a, b, strict=False):
        same += int(list(x) == list(y))
        n = 0
        for u, v in zip(x, y, strict=False):
            if u != v:
                break
            n += 1
        prefix_total += n
    return {"identical_fraction": same / len(a), "mean_common_prefix": prefix_total / len(a)}
