"""Shared fixtures for the server tests.

`tokenizer_dir` needs no engine (tokenizer/protocol unit tests). `engine` is ONE real
`multiserve.Engine` on the tiny random model (reliability/tiny_model.py: the default
model's tokenizer and full vocabulary, 2 layers): what tests/server checks is the HTTP
side (routes, schemas, streaming, control, errors), which no assertion ties to the
default model's text (that is tests/model's and the fleet's "Paris"); built once per
session with small shape buckets; `server` is a real uvicorn server for it on a free
loopback port. Tests leave the engine idle and unpaused (`idle_engine` checks and
restores that). The tiny model makes tests/server markedly quicker than the default model
would (docs/performance.md §10).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from loopback_server import engine_server
from shipped_engine import SHIPPED_FUSED_STEP_MAX, shipped_engine_config

ENGINE_KW: dict[str, Any] = dict(
    max_running_requests=64, precompile_bs_paddings=(64,), precompile_token_paddings=(64, 256),
    chunked_prefill_size=256, max_total_tokens=16384, max_context_len=2048,
    show_progress=False, fused_step_max=SHIPPED_FUSED_STEP_MAX)


@pytest.fixture(scope="session")
def tokenizer_dir() -> Path:
    """The default model's HF-format directory (jax-free to locate)."""
    from multiserve.model.loading.default_model import default_model_path

    return Path(default_model_path())


@pytest.fixture(scope="session")
def tm(tokenizer_dir: Path):
    from multiserve.server.tokenizer import TokenizerManager

    return TokenizerManager(tokenizer_dir, context_len=512, model_name="test-model")


@pytest.fixture(scope="session")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from multiserve.config import EngineConfig
    from multiserve.engine.engine import Engine
    from multiserve.reliability.tiny_model import write_tiny_model

    model = write_tiny_model(tmp_path_factory.mktemp("tiny-server"))
    eng = Engine(EngineConfig(model_path=str(model), **ENGINE_KW))
    yield eng
    eng.shutdown()


class Served:
    """A running server for the session engine: url, tokenizer manager, http client."""

    def __init__(self, engine: Any, thread: Any, tm: Any) -> None:
        self.engine = engine
        self.thread = thread
        self.tm = tm
        self.url = thread.url
        self.http = httpx.Client(base_url=thread.url, timeout=120)

    def state(self) -> dict[str, Any]:
        r = self.http.get("/get_server_info")
        r.raise_for_status()
        return r.json()

    def wait_state(self, pred: Any, timeout: float = 30.0) -> dict[str, Any]:
        """Poll /get_server_info until pred(state) holds (a condition, not a sleep)."""
        deadline = time.monotonic() + timeout
        while True:
            st = self.state()
            if pred(st):
                return st
            if time.monotonic() > deadline:
                raise AssertionError(f"condition not reached within {timeout}s: {st}")
            time.sleep(0.05)


@pytest.fixture(scope="session")
def served(engine: Any) -> Iterator[Served]:
    from multiserve.server import ServerThread, TokenizerManager, build_app

    tm = TokenizerManager(engine.tokenizer_dir, engine.context_len, engine.model_name,
                          tokenizer=engine.tokenizer)
    app = build_app(engine, tm, server_info={"model_path": str(engine.model_path),
                                             "tokenizer_path": str(engine.tokenizer_dir)})
    thread = ServerThread(app).start()
    s = Served(engine, thread, tm)
    yield s
    s.http.close()
    thread.stop()


@pytest.fixture(scope="module")
def client(served: Served) -> Iterator[openai.OpenAI]:
    """The official openai client on the session server (one per test module)."""
    with openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def hf_tok(served: Served) -> Any:
    """transformers' tokenizer of the session engine."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(served.engine.tokenizer_dir))


def _idle(st: dict[str, Any]) -> bool:
    return (not st["engine_paused"] and st["running_batch_size"] == 0
            and st["waiting_queue_size"] == 0)


@pytest.fixture()
def idle_engine(served: Served) -> Iterator[Served]:
    """The server, with its engine unpaused and idle before and after the test."""
    served.http.post("/continue_generation")
    served.wait_state(_idle)
    yield served
    served.http.post("/continue_generation")
    served.http.post("/abort_request", json={"abort_all": True})
    served.wait_state(_idle)


@pytest.fixture(scope="session")
def default_server_url() -> Iterator[str]:
    from multiserve.engine.engine import Engine

    # the shipped main job's engine (tests/shipped_engine.py): its programs and plan are the
    # validate run's and the engine tests' default engine's, found in the suite's caches
    eng = Engine(shipped_engine_config(compile_in_background=False))
    with engine_server(eng) as url:
        yield url
    eng.shutdown()
