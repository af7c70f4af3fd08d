"""Prometheus text for the supervisor's GET /metrics: every engine's state, labelled.

Owns: the fleet metric names (documented in sops/read-the-metrics.md; keep them in
step) and their rendering from one snapshot of the engines' states. Where a per-engine
server (multiserve/server/metrics.py) has the same quantity, the fleet name is its
name with `multiserve_` -> `multiserve_fleet_` plus `engine` and `port` labels.

Invariants: each scrape renders into its own fresh `CollectorRegistry` (never the
process-global default one, which the per-engine servers or a test may also use);
a value an engine did not report is left out, never invented; jax-free.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
)


class FleetCounters(Protocol):
    """What the metrics read from the supervisor besides the engines' states."""

    @property
    def restarts(self) -> Sequence[int]: ...  # per engine

    @property
    def control_counts(self) -> Mapping[tuple[str, str], int]: ...  # (op, outcome) -> n

PREFIX = "multiserve_fleet"
LABELS = ["engine", "port"]

# metric suffix -> (internal-state key, help text). Gauges, one sample per engine.
STATE_GAUGES: dict[str, tuple[str, str]] = {
    "engine_paused": ("engine_paused", "1 while the engine is paused (no step runs)"),
    "num_running_reqs": ("running_batch_size", "requests in the running batch"),
    "num_waiting_reqs": ("waiting_queue_size", "requests in the waiting queue"),
    "kv_total_tokens": ("max_total_tokens", "KV pool size in tokens"),
    "kv_available_tokens": ("available_kv_tokens",
                                   "KV tokens a new request could use now (free + evictable)"),
    "kv_evictable_tokens": ("evictable_kv_tokens",
                                   "KV tokens held only by the prefix cache (evictable)"),
    "prefix_cache_tokens": ("tree_cache_size", "tokens held by the prefix cache"),
    "prefix_cache_hit_tokens": ("prefix_cache_hit_tokens",
                                       "prompt tokens served from the prefix cache so far"),
    "req_to_token_used": ("req_to_token_pool_used", "request slots holding KV pages"),
    "decode_steps": ("forward_ct_decode", "decode steps since start or last flush"),
    "forward_steps": ("forward_ct", "forward steps (prefill + decode) since start"),
    "retractions": ("num_retractions", "requests retracted (KV freed, requeued)"),
    "new_token_ratio": ("new_token_ratio",
                               "scheduler's estimate of the share of max_new_tokens still due"),
    "recompiles": ("cache_miss_count", "jit cache misses (recompiles) since start"),
    "max_context_len": ("max_context_len", "longest prompt + output accepted"),
}


def render_metrics(sup: FleetCounters, states: list[dict[str, Any]]) -> tuple[bytes, str]:
    """(Prometheus text, content type) for one snapshot from `Supervisor.engine_states`."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(sup, states))
    return generate_latest(registry), CONTENT_TYPE_LATEST


class _Snapshot:
    def __init__(self, sup: FleetCounters, states: list[dict[str, Any]]) -> None:
        self.sup = sup
        self.states = states

    def collect(self) -> Iterator[Metric]:
        states = self.states
        count = GaugeMetricFamily(f"{PREFIX}_engines", "engines in the fleet")
        count.add_metric([], len(states))
        yield count
        up = _gauge("engine_healthy", "1 if the engine is healthy (its port answers)")
        state_ok = _gauge("engine_state_ok", "1 if the engine reported its state in time")
        for s in states:
            up.add_metric(_labels(s), 1.0 if s["healthy"] else 0.0)
            state_ok.add_metric(_labels(s), 0.0 if s["state"] is None else 1.0)
        yield up
        yield state_ok
        for suffix, (key, help_text) in STATE_GAUGES.items():
            family = _gauge(suffix, help_text)
            for s in states:
                value = _number((s["state"] or {}).get(key))
                if value is not None:
                    family.add_metric(_labels(s), value)
            yield family
        usage = _gauge("kv_cache_usage", "share of the KV pool held by live requests, 0..1")
        for s in states:
            st = s["state"] or {}
            total = _number(st.get("max_total_tokens"))
            free = _number(st.get("available_kv_tokens"))
            if total and free is not None:
                usage.add_metric(_labels(s), max(0.0, min(1.0, 1.0 - free / total)))
        yield usage
        info = InfoMetricFamily(f"{PREFIX}_engine_weight", "weights an engine serves",
                                labels=LABELS + ["weight_version", "model"])
        for s in states:
            version = (s["state"] or {}).get("weight_version")
            if version is not None:
                info.add_metric(_labels(s) + [str(version), str(s["model"])], {})
        yield info
        restarts = CounterMetricFamily(f"{PREFIX}_engine_restarts",
                                       "engine restarts done through the supervisor",
                                       labels=LABELS)
        for s in states:
            restarts.add_metric(_labels(s), self.sup.restarts[s["engine"]])
        yield restarts
        control = CounterMetricFamily(f"{PREFIX}_control_requests",
                                      "fleet-wide control broadcasts by operation and outcome",
                                      labels=["operation", "outcome"])
        for (op, outcome), n in sorted(self.sup.control_counts.items()):
            control.add_metric([op, outcome], n)
        yield control


def _gauge(suffix: str, help_text: str) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"{PREFIX}_{suffix}", help_text, labels=LABELS)


def _labels(s: dict[str, Any]) -> list[str]:
    return [str(s["engine"]), "" if s["port"] is None else str(s["port"])]


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return 1.0 if value else 0.0
    if isinstance(value, (int, float)):
        return float(value)
    if hasattr(value, "item"):  # a numpy scalar
        return float(value.item())
    return None
