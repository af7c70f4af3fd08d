"""multiserve: several JAX inference engines in one process, one per device group.

`multiserve.Engine` is exposed lazily (module `__getattr__`) so that importing the
package, or its jax-free parts (`multiserve.server`, `multiserve.types`,
`multiserve.config`), never imports jax.
"""

from typing import Any

__all__ = ["Engine", "EngineConfig", "OutputAssembler", "SamplingParams", "assembling"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "Engine":
        from multiserve.engine.engine import Engine

        return Engine
    if name == "EngineConfig":
        from multiserve.config import EngineConfig

        return EngineConfig
    if name in ("OutputAssembler", "assembling"):  # Engine.submit's sinks get deltas
        from multiserve.engine import streams

        return getattr(streams, name)
    if name == "SamplingParams":
        from multiserve.types import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'multiserve' has no attribute {name!r}")
