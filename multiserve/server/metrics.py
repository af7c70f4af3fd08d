"""Prometheus metrics of one HTTP app (one engine).

Owns: `ServerMetrics`, a per-app `CollectorRegistry` (several apps live in one process,
so nothing is registered in prometheus-client's global registry), the pure-ASGI
middleware that counts HTTP requests by endpoint and status, and the scrape-time
refresh of engine gauges from `get_internal_state()`.

Invariant: counters only ever grow; gauges reflect the engine at scrape time.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from multiserve.server.request_run import RequestRun

CONTENT_TYPE = CONTENT_TYPE_LATEST
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0,
                    40.0, 80.0, 160.0, 320.0)


class ServerMetrics:
    """Counters, histograms and gauges of one server, in their own registry."""

    def __init__(self, prefix: str = "multiserve") -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r, p = self.registry, prefix
        self.http_requests = Counter(f"{p}_http_requests", "HTTP requests by endpoint and status",
                                     ["endpoint", "status"], registry=r)
        self.requests_finished = Counter(f"{p}_requests_finished",
                                         "Generation samples finished, by finish reason",
                                         ["finish_reason"], registry=r)
        self.prompt_tokens = Counter(f"{p}_prompt_tokens", "Prompt tokens processed", registry=r)
        self.cached_tokens = Counter(f"{p}_cached_prompt_tokens",
                                     "Prompt tokens served from the prefix cache", registry=r)
        self.generation_tokens = Counter(f"{p}_generation_tokens", "Tokens generated",
                                         registry=r)
        self.ttft = Histogram(f"{p}_time_to_first_token_seconds", "Time to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(f"{p}_e2e_request_latency_seconds", "End-to-end request latency",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.running = Gauge(f"{p}_num_running_reqs", "Requests in the running batch", registry=r)
        self.waiting = Gauge(f"{p}_num_waiting_reqs", "Requests in the waiting queue",
                             registry=r)
        self.kv_usage = Gauge(f"{p}_kv_cache_usage", "Fraction of KV token slots in use",
                              registry=r)
        self.kv_available = Gauge(f"{p}_kv_available_tokens", "Free KV token slots",
                                  registry=r)
        self.paused = Gauge(f"{p}_engine_paused", "1 while generation is paused", registry=r)
        self.healthy = Gauge(f"{p}_engine_healthy", "1 while the engine is healthy", registry=r)
        # speculative decoding, the engine's running totals (gauges set at scrape time)
        self.spec_verify = Gauge(f"{p}_spec_verify_steps",
                                 "Verify rows run (speculative decoding)", registry=r)
        self.spec_proposed = Gauge(f"{p}_spec_draft_tokens",
                                   "Draft tokens proposed for verification", registry=r)
        self.spec_accepted = Gauge(f"{p}_spec_accepted_tokens",
                                   "Draft tokens accepted (equal to the sampled token)",
                                   registry=r)

    def observe_run(self, run: RequestRun) -> None:
        """Record a finished (or abandoned) engine request."""
        self.prompt_tokens.inc(run.prompt_tokens)
        self.cached_tokens.inc(run.cached_tokens)
        self.generation_tokens.inc(run.completion_tokens)
        if run.first_token_at is not None:
            self.ttft.observe(run.first_token_at - run.started)
        self.e2e.observe(run.e2e_latency)
        for st in run.samples:
            self.requests_finished.labels(finish_reason=st.finish_reason or "abort").inc()

    def refresh(self, state: dict[str, Any], healthy: bool) -> None:
        """Set the gauges from the engine's internal state (at scrape time)."""
        self.healthy.set(1.0 if healthy else 0.0)
        self.running.set(float(state.get("running_batch_size", 0) or 0))
        self.waiting.set(float(state.get("waiting_queue_size", 0) or 0))
        self.paused.set(1.0 if state.get("engine_paused") else 0.0)
        self.spec_verify.set(float(state.get("spec_verify_ct", 0) or 0))
        self.spec_proposed.set(float(state.get("spec_proposed_tokens", 0) or 0))
        self.spec_accepted.set(float(state.get("spec_accepted_tokens", 0) or 0))
        avail = state.get("available_kv_tokens")
        if avail is not None:
            self.kv_available.set(float(avail))
        total = state.get("max_total_tokens") or state.get("total_kv_tokens")
        if avail is not None and total:
            self.kv_usage.set(max(0.0, min(1.0, 1.0 - float(avail) / float(total))))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class MetricsMiddleware:
    """Pure ASGI middleware counting HTTP responses by (route, status)."""

    def __init__(self, app: Any, metrics: ServerMetrics, known_paths: frozenset[str]) -> None:
        self.app = app
        self.metrics = metrics
        self.known = known_paths

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        endpoint = path if path in self.known else "other"
        status = {"code": 500}

        async def send_wrapper(message: Any) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            self.metrics.http_requests.labels(endpoint=endpoint, status=str(status["code"])).inc()
