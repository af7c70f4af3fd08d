"""Issue 21: an oversized request is refused before it costs parsing or tokenizing.

- A body over `max_request_bytes` gets 413 with an OpenAI error body stating the limit,
  before anything parses it (invalid JSON over the limit is a 413, not a 400), on every
  generation route, with or without a Content-Length; the server keeps serving.
- A prompt over `TokenizerManager.max_prompt_chars` (the context length x the most
  characters one token can stand for) gets 400 naming the field and stating the limit,
  and the tokenizer never sees it (chat, completions, /generate, /v1/score).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.slow

LIMIT = 64 * 1024
ROUTES = ("/v1/chat/completions", "/v1/completions", "/generate", "/v1/score",
          "/pause_generation")


class CountingTokenizer:
    """The engine's tokenizer, counting the calls that tokenize or render a prompt."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.calls: list[str] = []

    def encode(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append("encode")
        return self._inner.encode(*args, **kwargs)

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append("apply_chat_template")
        return self._inner.apply_chat_template(*args, **kwargs)

    def __len__(self) -> int:
        return len(self._inner)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@pytest.fixture()
def small_limit(served: Any, idle_engine: Any) -> Iterator[str]:
    """A second app for the session engine that accepts bodies up to LIMIT bytes."""
    from multiserve.server import ServerThread, build_app

    with ServerThread(build_app(served.engine, served.tm, max_request_bytes=LIMIT)) as srv:
        yield srv.url


def _assert_too_large(r: httpx.Response) -> None:
    assert r.status_code == 413, r.text[:300]
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == "request_too_large" and str(LIMIT) in err["message"], err


def test_a_body_over_the_limit_is_a_413_before_parsing(small_limit: str, served: Any) -> None:
    model = served.engine.model_name
    big_text = "word " * (LIMIT // 4)
    bodies = {"/v1/chat/completions": {"model": model, "messages": [
                  {"role": "user", "content": big_text}]},
              "/v1/completions": {"model": model, "prompt": big_text},
              "/generate": {"text": big_text},
              "/v1/score": {"query": big_text, "items": ["a"], "label_token_ids": [1]},
              "/pause_generation": {"mode": "in_place", "padding": big_text}}
    with httpx.Client(base_url=small_limit, timeout=60) as h:
        for path in ROUTES:
            _assert_too_large(h.post(path, json=bodies[path]))
            # not JSON at all: still 413, so the bound comes before parsing
            _assert_too_large(h.post(path, content=b"{" * (LIMIT + 1),
                                     headers={"Content-Type": "application/json"}))

            def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
                yield b'{"text": "'
                for _ in range(LIMIT // 1024 + 1):
                    yield b"x" * 1024
                yield b'"}'

            _assert_too_large(h.post(path, content=chunks(),
                                     headers={"Content-Type": "application/json"}))
        # within the limit, the same server serves (also a chunked body)
        ok = h.post("/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 2})
        assert ok.status_code == 200, ok.text
        ok = h.post("/generate", content=iter([b'{"text": "Hi", ', b'"sampling_params": '
                                               b'{"max_new_tokens": 2}}']),
                    headers={"Content-Type": "application/json"})
        assert ok.status_code == 200 and ok.json()["meta_info"]["completion_tokens"] == 2
        assert h.get("/get_server_info").json()["max_request_bytes"] == LIMIT
    st = served.state()
    assert st["running_batch_size"] == 0 and st["waiting_queue_size"] == 0
    assert not st["engine_paused"]  # the refused /pause_generation never ran


def test_a_prompt_over_the_character_bound_is_refused_before_tokenizing(
        served: Any, idle_engine: Any) -> None:
    from multiserve.server import ServerThread, TokenizerManager, build_app

    eng = served.engine
    counting = CountingTokenizer(eng.tokenizer)
    tm = TokenizerManager(eng.tokenizer_dir, eng.context_len, eng.model_name,
                          tokenizer=counting)
    limit = tm.max_prompt_chars
    assert limit == eng.context_len * tm.chars_per_token
    assert limit < 5_000_000  # the 5 MB chat is refused this way
    long = "a" * (limit + 1)
    cases = [
        ("/v1/chat/completions", {"messages": [{"role": "system", "content": "be brief"},
                                               {"role": "user", "content": long}]}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": long[:limit // 2]},
                                               {"role": "assistant", "content": "ok"},
                                               {"role": "user", "content": long[:limit // 2]}]},
         "messages"),
        ("/v1/completions", {"prompt": long}, "prompt"),
        ("/v1/completions", {"prompt": ["short", long]}, "prompt"),
        ("/generate", {"text": long}, "text"),
        ("/generate", {"text": ["short", long]}, "text"),
        ("/v1/score", {"query": "q", "items": ["a", long], "label_token_ids": [1]}, "items"),
    ]
    with ServerThread(build_app(eng, tm)) as srv, httpx.Client(base_url=srv.url,
                                                                timeout=60) as h:
        for path, body, param in cases:
            r = h.post(path, json={"model": eng.model_name, **body})
            assert r.status_code == 400, (path, param, r.text[:300])
            err = r.json()["error"]
            assert err["param"] == param and err["code"] == "context_length_exceeded", err
            assert str(limit) in err["message"] and err["message"].startswith(f"{param}:"), err
            assert counting.calls == [], (path, counting.calls)  # never tokenized
        # at the bound the prompt is tokenized (and the engine refuses it by its tokens)
        r = h.post("/v1/completions", json={"prompt": long[:limit], "max_tokens": 1})
        assert r.status_code == 400 and counting.calls == ["encode"], r.text[:300]
        assert r.json()["error"]["param"] == "prompt"
        assert "tokens" in r.json()["error"]["message"]
        assert h.get("/get_server_info").json()["max_prompt_chars"] == limit
