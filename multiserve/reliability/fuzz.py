"""Schema fuzzing of a running app with schemathesis: every operation of its OpenAPI
document, positive and negative bodies, against a real server on loopback.

Owns `fuzz_server(name, url, cases)` -> `FuzzReport`, and the per-case rules:
- violations (the run fails): any 5xx; a 4xx whose body is not an OpenAI error object
  (`{"error": {"message": str, "type": str, ...}}`); a transport error or timeout (a
  hung request); an SSE stream that does not end with `data: [DONE]` or carries a 5xx
  error event (a stream still going when the case timeout ends is read no further by
  schemathesis: counted as a finding, not checked);
  an answer that disagrees with what the document declares for it (schemathesis'
  conformance checks: status code, content type, body, each SSE event): the document
  and the answer must agree;
- findings (reported, not failing): a stream cut short by the case timeout, and cases
  the generator could not make.
Besides the generated cases, each streaming operation is sent `STREAM_EXAMPLES` (a
valid streamed request with logprobs, n > 1, usage and, where the API has them, token
ids), so every SSE event shape is checked on every run: generated cases reach a 200
stream only rarely; and `EXTRA_EXAMPLES` (routing replay on /generate).
After every case that can leave the server paused or asleep (pause, memory release,
weight staging, a weight-update session) the harness aborts the session, continues and
resumes it, so later generation cases run.

Invariants: cases are generated from the app's own /openapi.json and sent one at a time
(bounded: `cases` in total, each with a timeout); the harness never retries a case, and
only ever talks to `url` (loopback by construction of the callers).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

CASE_TIMEOUT_S = 60.0
RESTART_CASES = 4  # /restart_engine rebuilds an engine: a few cases are enough
MAX_ROUNDS = 6
MAX_STREAM_EVENTS = 1_000_000
# A valid streamed request per streaming operation, sent on every run (module docstring).
STREAM_EXAMPLES: dict[str, dict[str, Any]] = {
    "POST /v1/completions": {
        "prompt": "Hello", "max_tokens": 4, "stream": True, "n": 2, "logprobs": 2,
        "echo": True, "stream_options": {"include_usage": True}, "return_token_ids": True,
        "return_tokens_as_token_ids": True},
    "POST /v1/chat/completions": {
        "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4, "stream": True,
        "n": 2, "logprobs": True, "top_logprobs": 2, "stream_options": {"include_usage": True},
        "return_token_ids": True, "return_tokens_as_token_ids": True},
    "POST /generate": {
        "text": ["Hello", "Hi"], "stream": True, "return_logprob": True,
        "top_logprobs_num": 2, "sampling_params": {"max_new_tokens": 4, "n": 2}},
    "POST /inference/v1/generate": {
        "token_ids": [1, 2, 3], "stream": True, "stream_options": {"include_usage": True},
        "sampling_params": {"max_tokens": 4, "n": 2, "logprobs": 2}},
}
# Valid requests sent once per run besides the generated cases: routing replay, which a
# MoE server started with --enable-return-routed-experts answers (200, the ids in the final
# object / chunk) and any other refuses (400 with an error body naming the field).
EXTRA_EXAMPLES: dict[str, list[dict[str, Any]]] = {
    "POST /generate": [
        {"input_ids": [1, 2, 3], "return_routed_experts": True, "routed_experts_start_len": 1,
         "sampling_params": {"max_new_tokens": 3}},
        {"input_ids": [[1, 2], [3, 4, 5]], "return_routed_experts": True, "stream": True,
         "sampling_params": {"max_new_tokens": 3, "n": 2}}],
    # the JAX weight transfer: a join (lazy: 200 with no trainer there), then updates
    # refused before any pull (a wrong shape; a group never joined)
    "POST /init_weights_update_group": [
        {"master_address": "127.0.0.1", "master_port": 9, "rank_offset": 1, "world_size": 2,
         "group_name": "fuzz", "backend": "jax"}],
    "POST /update_weights_from_distributed": [
        {"names": ["model.embed_tokens.weight"], "dtypes": ["bfloat16"], "shapes": [[1, 1]],
         "group_name": "fuzz", "transfer_uuid": 1},
        {"names": ["model.embed_tokens.weight"], "dtypes": ["float32"], "shapes": [[1]],
         "group_name": "never-joined", "weight_version": "v"}],
}
RESTORING = ("/pause_generation", "/release_memory_occupation", "/stage_weights_from_disk",
             "/update_weights_from_disk", "/restart_engine", "/pause",
             "/areal_pause_generation", "/start_weight_update", "/update_weights")


@dataclass
class FuzzReport:
    name: str
    url: str
    cases: int = 0
    statuses: Counter[int] = field(default_factory=Counter)
    per_operation: Counter[str] = field(default_factory=Counter)
    per_status: Counter[tuple[str, int]] = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)
    findings: Counter[str] = field(default_factory=Counter)
    # schema-valid (positive) cases the server refused: where the schema is looser than
    # the validation (context length, prompt ids in vocabulary, ...), by message
    positive_refusals: Counter[str] = field(default_factory=Counter)
    seconds: float = 0.0

    @property
    def server_errors(self) -> int:
        return sum(n for s, n in self.statuses.items() if s >= 500)

    @property
    def ok(self) -> bool:
        return not self.violations

    def lines(self) -> list[str]:
        statuses = " ".join(f"{s}:{n}" for s, n in sorted(self.statuses.items()))
        out = [f"FUZZ {self.name}: cases={self.cases} operations={len(self.per_operation)} "
               f"statuses=[{statuses}] 5xx={self.server_errors} "
               f"violations={len(self.violations)} seconds={self.seconds:.1f}"]
        out += [f"  violation: {v}" for v in self.violations[:20]]
        out += [f"  finding x{n}: {f}" for f, n in self.findings.most_common(10)]
        return out


def _error_body_problem(resp: Any) -> str | None:
    try:
        body = resp.json()
    except ValueError:
        return f"not JSON: {resp.text[:120]!r}"
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict):
        return f"no 'error' object: {resp.text[:160]!r}"
    if not isinstance(err.get("message"), str) or not err["message"]:
        return "error.message missing"
    if not isinstance(err.get("type"), str):
        return "error.type missing"
    return None


def _stream_problem(text: str) -> str | None:
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    if not events or events[-1] != "[DONE]":
        return "SSE stream without a final 'data: [DONE]'"
    for e in events[:-1]:
        try:
            obj = json.loads(e)
        except ValueError:
            return f"SSE event is not JSON: {e[:80]!r}"
        err = obj.get("error") if isinstance(obj, dict) else None
        if isinstance(err, dict) and str(err.get("type", "")).startswith("Internal"):
            return f"SSE 5xx error event: {err.get('message')!r}"
    return None


def _header(resp: Any, name: str) -> str:
    """A response header whether the headers map to strings (httpx) or to lists of
    strings (schemathesis' Response)."""
    value = resp.headers.get(name) or resp.headers.get(name.lower()) or ""
    return value[0] if isinstance(value, list) and value else str(value or "")


def check_answer(resp: Any) -> str | None:
    """The violation in one answer (an httpx or requests response), if any (see the
    module docstring)."""
    if resp.status_code >= 500:
        return f"HTTP {resp.status_code}: {resp.text[:200]!r}"
    if resp.status_code >= 400:
        problem = _error_body_problem(resp)
        return None if problem is None else f"HTTP {resp.status_code} {problem}"
    if _header(resp, "content-type").startswith("text/event-stream"):
        return _stream_problem(resp.text)
    return None


def _first_failure(e: BaseException) -> str:
    """The first concrete failure of a schemathesis check, on one line."""
    while isinstance(e, BaseExceptionGroup) and e.exceptions:
        e = e.exceptions[0]
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:300]}"


def restore(http: httpx.Client) -> None:
    """Leave the server generating: continue, resume memory, drop staged weights."""
    for path, body in (("/abort_weight_update", None), ("/continue_generation", None),
                       ("/resume_memory_occupation", {}), ("/discard_staged_weights", {})):
        try:
            http.post(path, json=body)
        except httpx.HTTPError:
            pass


def fuzz_server(name: str, url: str, cases: int, *, seed: int = 0,
                headers: dict[str, str] | None = None, case_timeout: float = CASE_TIMEOUT_S,
                operations: set[str] | None = None) -> FuzzReport:
    """Fuzz every operation of `url`'s /openapi.json (or only `operations`, given as
    "POST /generate", ...) with about `cases` cases in all."""
    import hypothesis
    import schemathesis
    from hypothesis import HealthCheck, Phase
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        response_schema_conformance,
        status_code_conformance,
    )

    report = FuzzReport(name, url)
    t0 = time.monotonic()
    # schemathesis stops reading an SSE stream after 20 events by default: read it all
    config = schemathesis.Config.from_dict({"max-stream-events": MAX_STREAM_EVENTS})
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json", headers=headers or {},
                                           config=config)
    ops = [op for op in (r.ok() for r in schema.get_all_operations())
           if operations is None or f"{op.method.upper()} {op.path}" in operations]
    modes = (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE)
    checks = [status_code_conformance, content_type_conformance, response_schema_conformance]
    http = httpx.Client(base_url=url, headers=headers, timeout=case_timeout)

    def one(case: Any) -> None:
        label = f"{case.method} {case.path}"
        report.cases += 1
        report.per_operation[label] += 1
        try:
            resp = case.call(base_url=url, headers=headers, timeout=case_timeout)
        except Exception as e:  # noqa: BLE001 - a transport error or a hung request
            report.violations.append(f"{label}: {type(e).__name__}: {str(e)[:200]}")
            return
        finally:
            if case.path in RESTORING:
                restore(http)
        report.statuses[resp.status_code] += 1
        report.per_status[(label, resp.status_code)] += 1
        if getattr(resp, "stream_cut_short", False):  # the case timeout ended the read
            report.findings[f"{label}: stream longer than {case_timeout:g} s, not "
                            f"checked to its end"] += 1
            return
        problem = check_answer(resp)
        mode = case.meta.generation.mode.value if case.meta else "example"
        if mode == "positive" and 400 <= resp.status_code < 500 and problem is None:
            message = resp.json()["error"]["message"]
            report.positive_refusals[f"{label} {resp.status_code}: {message[:90]}"] += 1
        if problem is not None:
            report.violations.append(f"{label} ({mode}): {problem}; reproduce: "
                                     f"{case.as_curl_command(headers=headers)[:4000]}")
        try:
            case.validate_response(resp, checks=checks)
        except (Exception, BaseExceptionGroup) as e:  # noqa: BLE001 - the document disagrees
            report.violations.append(f"{label} {resp.status_code} ({mode}): answer does not "
                                     f"match the document: {_first_failure(e)}; reproduce: "
                                     f"{case.as_curl_command(headers=headers)[:4000]}")

    def fuzz(op: Any, mode: Any, n: int, case_seed: int) -> int:
        """Up to n cases of `op` in `mode`; returns how many were sent."""
        before = report.cases

        @hypothesis.seed(case_seed)
        @hypothesis.settings(max_examples=n, deadline=None, database=None,
                             phases=[Phase.generate], suppress_health_check=list(HealthCheck),
                             verbosity=hypothesis.Verbosity.quiet)
        @hypothesis.given(op.as_strategy(generation_mode=mode))
        def run(case: Any) -> None:
            try:
                one(case)
            except Exception as e:  # noqa: BLE001 - the harness's own failure
                report.violations.append(f"harness error on {case.method} {case.path}: "
                                         f"{type(e).__name__}: {e}")

        try:
            run()
        except hypothesis.errors.Unsatisfiable:
            pass  # no invalid input exists (e.g. a GET without parameters)
        except Exception as e:  # noqa: BLE001 - reported
            report.findings[f"{op.method.upper()} {op.path} {mode.value}: "
                            f"{type(e).__name__}: {str(e)[:100]}"] += 1
        return report.cases - before

    for op in ops:
        example = STREAM_EXAMPLES.get(f"{op.method.upper()} {op.path}")
        if example is not None:
            one(op.Case(body=example, media_type="application/json"))
        for extra in EXTRA_EXAMPLES.get(f"{op.method.upper()} {op.path}", ()):
            one(op.Case(body=extra, media_type="application/json"))
    # Rounds: operations whose inputs ran out (a GET without parameters has one case)
    # leave their share to the others, until `cases` were sent or nothing is left.
    active = [(op, mode) for op in ops for mode in modes]
    for rnd in range(MAX_ROUNDS):
        if report.cases >= cases or not active:
            break
        per = max(2, -(-(cases - report.cases) // len(active)))
        still = []
        for k, (op, mode) in enumerate(active):
            n = min(per, RESTART_CASES) if op.path == "/restart_engine" else per
            if rnd and op.path == "/restart_engine":
                continue  # restarts are slow: one round of them is enough
            if fuzz(op, mode, n, seed * 100_003 + rnd * 1009 + k) >= n:
                still.append((op, mode))
        active = still
    http.close()
    report.seconds = time.monotonic() - t0
    return report

