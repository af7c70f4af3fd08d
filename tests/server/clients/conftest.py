"""Fixtures for the client-family tests: each module replays one RL framework's exact
requests against a real server on loopback.

`tiny` is one engine on a tiny random Llama (the SmolLM2 tokenizer, its first TINY_VOCAB
ids) behind a real uvicorn server with the RL routes, built once per session with the same
shapes as tests/engine's tiny engines (compiled shapes come from the persistent cache).
The SmolLM2 `served` fixture (tests/server/conftest.py) gives end-to-end text truths.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

TINY_VOCAB = 512
# tests/engine/engine_helpers.TINY_ENGINE (shared compiled shapes)
TINY_ENGINE: dict[str, Any] = dict(
    precompile_token_paddings=(64, 128), precompile_bs_paddings=(64,),
    max_running_requests=64, chunked_prefill_size=32, page_size=8, max_total_tokens=8192,
    max_context_len=1024, show_progress=False)


def tiny_config() -> Any:
    from multiserve.config import ModelConfig

    return ModelConfig(
        architecture="llama", vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128,
        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=2048,
        tie_word_embeddings=False, bos_token_id=1, eos_token_ids=(2,))


def varied_params(cfg: Any, seed: int = 0) -> dict[str, Any]:
    """Random weights whose greedy output is varied and depends on the whole context."""
    from multiserve.model.param_layout import param_shapes

    rng = np.random.default_rng(seed)

    def init(name: str, shape: tuple[int, ...]) -> np.ndarray:
        if "norm" in name:
            return np.ones(shape, np.float32)
        if name == "embed":
            return rng.standard_normal(shape).astype(np.float32)
        return (rng.standard_normal(shape) / np.sqrt(shape[-2])).astype(np.float32)

    shapes = param_shapes(cfg)
    return {k: ({n: init(n, s) for n, s in v.items()} if k == "layers" else init(k, v))
            for k, v in shapes.items()}


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from multiserve.model.default_model import default_model_path
    from multiserve.model.loader import save_hf_dir

    cfg = tiny_config()
    return save_hf_dir(tmp_path_factory.mktemp("tiny-clients"), cfg, varied_params(cfg),
                       tokenizer_dir=default_model_path())


class Live:
    """A real server on loopback for one engine: url, engine, a sync http client."""

    def __init__(self, engine: Any, thread: Any) -> None:
        self.engine = engine
        self.thread = thread
        self.url = thread.url
        self.http = httpx.Client(base_url=thread.url, timeout=120)

    def state(self) -> dict[str, Any]:
        r = self.http.get("/get_server_info")
        r.raise_for_status()
        return r.json()

    def wait_state(self, pred: Any, timeout: float = 60.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            st = self.state()
            if pred(st):
                return st
            if time.monotonic() > deadline:
                raise AssertionError(f"condition not reached within {timeout}s: {st}")
            time.sleep(0.02)

    def idle(self) -> None:
        self.http.post("/continue_generation")
        self.http.post("/abort_request", json={"abort_all": True})
        self.wait_state(lambda s: not s["engine_paused"] and s["running_batch_size"] == 0
                        and s["waiting_queue_size"] == 0)


@pytest.fixture(scope="session")
def _tiny_live(tiny_dir: Path) -> Iterator[Live]:
    from multiserve.config import EngineConfig
    from multiserve.engine.engine import Engine
    from multiserve.server import ServerThread, TokenizerManager, build_app
    from multiserve.server.rl_routes import add_rl_routes

    engine = Engine(EngineConfig(model_path=str(tiny_dir), **TINY_ENGINE))
    tm = TokenizerManager(engine.tokenizer_dir, engine.context_len, engine.model_name)
    app = build_app(engine, tm, server_info={"model_path": str(tiny_dir),
                                             "tokenizer_path": str(tiny_dir)})
    add_rl_routes(app, engine)
    thread = ServerThread(app).start()
    live = Live(engine, thread)
    yield live
    live.http.close()
    thread.stop()
    engine.shutdown()


@pytest.fixture()
def tiny(_tiny_live: Live) -> Iterator[Live]:
    """The tiny server, idle and unpaused before and after the test."""
    _tiny_live.idle()
    yield _tiny_live
    _tiny_live.idle()


def prompt_ids(seed: int, n: int = 12) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(3, TINY_VOCAB, n)]
