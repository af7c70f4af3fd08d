"""Joining the slice: JAX's CPU collectives and `jax.distributed.initialize`, once per
process, before anything touches a device.

On CPU the collectives between processes are gloo's (jax_cpu_collectives_implementation
"gloo"); an accelerator's own interconnect needs no setting. After `initialize`,
`jax.devices()` is the GLOBAL list (every host's devices, by process then local index)
and `jax.local_devices()` this host's.
"""

from __future__ import annotations

from multiserve.config import MultiHostConfig

_JOINED: list[MultiHostConfig] = []


def join_slice(cfg: MultiHostConfig) -> None:
    """Initialise JAX for `cfg` (nothing with nnodes == 1). Idempotent for one config;
    a second, different config in the same process is an error."""
    if not cfg.enabled:
        return
    if _JOINED:
        if _JOINED[0] != cfg:
            raise RuntimeError(f"this process joined {_JOINED[0]} already")
        return
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(cfg.dist_init_addr, cfg.nnodes, cfg.node_rank,
                               initialization_timeout=int(cfg.startup_timeout_s))
    jax.devices()  # the backend starts on every host at once (it exchanges topologies)
    _JOINED.append(cfg)


def joined() -> MultiHostConfig | None:
    return _JOINED[0] if _JOINED else None
