"""Device-agnostic HTTP side: one OpenAI-compatible FastAPI app per engine.

Never imports jax (directly or through anything it imports); talks to an engine only
through `multiserve.types.EngineClient`.
"""

from multiserve.server.app import build_app
from multiserve.server.metrics import ServerMetrics
from multiserve.server.server_thread import ServerThread
from multiserve.server.tokenizer import TokenizerManager

__all__ = ["ServerMetrics", "ServerThread", "TokenizerManager", "build_app"]
