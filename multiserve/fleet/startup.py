"""Start-up steps that come before any engine exists: the platform, JAX, the compilation
cache, the fleet config from command-line arguments, and a free-port check.

Owns: `init_jax` (platform set-up, then JAX's one initialisation), `enable_compilation_cache`,
`fleet_config_from_args` (`--config` / `--engines` / port, host and model overrides) and
`check_ports_free`.

Invariants: `init_jax` sets the virtual CPU device count before JAX's backends start and
never assumes CPU otherwise (devices are whatever `jax.devices()` returns); nothing in
this module imports jax at module level, so importing it never starts JAX.
"""

from __future__ import annotations

import argparse
import os
import socket
import tomllib
from dataclasses import replace
from pathlib import Path
from typing import Any

from multiserve.config import API_KEY_ENV, ConfigError, FleetConfig
from multiserve.fleet.config_loader import fleet_config_from_dict
from multiserve.fleet.sglang_flags import apply_sglang_flags

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "cpu-4.toml"
CACHE_ENV = "MULTISERVE_JAX_CACHE"  # a directory, or "off" to disable the cache


# ---- JAX ------------------------------------------------------------------------------

def init_jax(platform: str, device_count_needed: int) -> list[Any]:
    """Prepare the platform, then initialise JAX (once) and return `jax.devices()`.

    "cpu" and "auto" ask the host (CPU) platform for `device_count_needed` virtual
    devices unless XLA_FLAGS already says how many (the flag only affects the CPU
    backend, so on an accelerator host it changes nothing). "cpu", "tpu" and "gpu"
    also pin JAX_PLATFORMS unless it is set, so a missing accelerator is an error, not a
    silent fall-back to CPU. Must run before JAX's backends start (first device use).
    """
    if platform in ("cpu", "auto"):
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_force_host_platform_device_count" not in flags:
            os.environ["XLA_FLAGS"] = (
                f"{flags} --xla_force_host_platform_device_count={device_count_needed}").strip()
    if platform != "auto":
        os.environ.setdefault("JAX_PLATFORMS", platform)
    import jax

    return list(jax.devices())


def enable_compilation_cache() -> str | None:
    """Turn on JAX's persistent compilation cache; returns its directory (None: off).

    Directory: $MULTISERVE_JAX_CACHE, else $JAX_COMPILATION_CACHE_DIR, else
    ~/.cache/multiserve/jax. Restarted engines and repeated start-ups load their
    compiled shapes from it instead of compiling again."""
    import jax

    choice = os.environ.get(CACHE_ENV)
    if choice is not None and choice.strip().lower() in ("", "0", "off", "none", "false"):
        return None
    path = choice or os.environ.get("JAX_COMPILATION_CACHE_DIR") or str(
        Path.home() / ".cache" / "multiserve" / "jax")
    Path(path).mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return path


# ---- configuration from the command line ----------------------------------------------

def fleet_config_from_args(args: argparse.Namespace) -> FleetConfig:
    """`--config` (or, without it, `--engines N`: N engines x 1 device, default engine
    settings; with neither, configs/cpu-4.toml). `--port` (first engine port, 0 for
    ephemeral), `--supervisor-port`, `--host`, `--model`, `--max-request-bytes` and
    `--enable-memory-saver` (sets it; absent, the file decides), and the engine keys
    `--speculative-algorithm` / `--speculative-num-draft-tokens` /
    `--decode-steps-per-dispatch` override the file;
    `--engines N` with `--config` keeps the file's first N engines. `--api-key` (else
    $MULTISERVE_API_KEY) protects every endpoint. SGLang's flags (fleet/sglang_flags.py)
    override the file too; `--tp-size` without --config lays out `--engines` (default 1)
    engines of that many devices."""
    engines = getattr(args, "engines", None)
    path = getattr(args, "config", None)
    if path is None and engines is None and getattr(args, "tp_size", None) is not None:
        engines = 1  # SGLang's one server of --tp-size devices
    if path is None and engines is None:
        path = str(DEFAULT_CONFIG)
    if engines is not None and engines < 1:
        raise ConfigError("engines", f"must be >= 1, got {engines}")
    base_dir: Path | None = None
    if path is not None:
        data = _read_toml(Path(path).expanduser())
        base_dir = Path(path).expanduser().parent
        if engines is not None:
            listed = data.get("engines")
            if not isinstance(listed, list) or engines > len(listed):
                raise ConfigError("engines", f"--engines {engines}: the config has only "
                                  f"{len(listed) if isinstance(listed, list) else 0}")
            data["engines"] = listed[:engines]
    else:
        data = {"fleet": {"platform": "auto"},
                "engines": [{"device_indexes": [i]} for i in range(engines or 1)]}
    fleet = dict(data.get("fleet") or {})
    if getattr(args, "port", None) is not None:
        fleet.pop("ports", None)
        fleet["base_port"] = args.port
    if getattr(args, "supervisor_port", None) is not None:
        fleet["supervisor_port"] = args.supervisor_port
    if getattr(args, "front_door_port", None) is not None:
        fleet["front_door_port"] = args.front_door_port
    if getattr(args, "host", None) is not None:
        fleet["host"] = args.host
    if getattr(args, "max_request_bytes", None) is not None:
        fleet["max_request_bytes"] = args.max_request_bytes
    if getattr(args, "enable_memory_saver", False):
        fleet["enable_memory_saver"] = True
    for key in ("tool_call_parser", "reasoning_parser"):
        if getattr(args, key, None) is not None:
            fleet[key] = getattr(args, key)
    if getattr(args, "chat_template", None) is not None:  # relative to the cwd
        fleet["chat_template"] = str(Path(args.chat_template).expanduser().absolute())
    data["fleet"] = fleet
    engine = dict(data.get("engine") or {})
    if getattr(args, "speculative_algorithm", None) is not None:
        engine["speculative_algorithm"] = args.speculative_algorithm
    if getattr(args, "speculative_num_draft_tokens", None) is not None:
        engine["speculative_num_draft_tokens"] = args.speculative_num_draft_tokens
    if getattr(args, "decode_steps_per_dispatch", None) is not None:
        engine["decode_steps_per_dispatch"] = args.decode_steps_per_dispatch
    if engine:
        data["engine"] = engine
    if getattr(args, "model", None) is not None:
        data["model"] = {**(data.get("model") or {}), "path": args.model}
        base_dir = Path.cwd()
    apply_sglang_flags(args, data, from_file=path is not None)
    cfg = fleet_config_from_dict(data, base_dir=base_dir)
    api_key = getattr(args, "api_key", None) or os.environ.get(API_KEY_ENV) or None
    return replace(cfg, api_key=api_key) if api_key else cfg


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError("config", f"no such file: {path}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError("config", f"{path} is not valid TOML: {e}") from None


def check_ports_free(cfg: FleetConfig) -> None:
    """Fail before minutes of warm-up if a configured port is taken (names the field)."""
    wanted = [("fleet.base_port/fleet.ports", f"engine {i}'s", s.host, s.port)
              for i, s in enumerate(cfg.servers)]
    wanted.append(("fleet.supervisor_port", "the supervisor's", cfg.supervisor.host,
                   cfg.supervisor.port))
    if cfg.front_door is not None:
        wanted.append(("fleet.front_door_port", "the front door's", cfg.front_door.host,
                       cfg.front_door.port))
    for name, whose, host, port in wanted:
        if port == 0:
            continue
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError as e:
                raise ConfigError(name, f"{whose} port {port} on {host} is not free: "
                                  f"{e.strerror}") from None
