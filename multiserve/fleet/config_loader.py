"""Fleet config files (configs/*.toml) -> a validated, frozen `FleetConfig`.

Owns: the TOML schema below, its type checking, and the mapping onto `EngineConfig`,
`ServerConfig` and `FleetConfig`; `validate_against_devices` for the check that needs
the live device count (which only the launcher knows, after JAX starts).

Schema (every table and key is optional unless marked; unknown keys are errors)::

    [model]
    path = "default"          # "default" / absent: the embedded SmolLM2-135M-Instruct;
                              # else a Hugging Face model dir or a .gguf file. Relative
                              # paths are relative to the config file; "~" is expanded.
    served_model_name = "x"   # the name /v1/models reports (default: from the model)

    [fleet]
    platform = "cpu"          # "cpu" | "auto" | "tpu" | "gpu"  (cpu: virtual devices)
    host = "127.0.0.1"        # every server (engines and supervisor) binds here
    base_port = 31000         # engine i listens on base_port + i (0: every port ephemeral)
    ports = [31000, 31001]    # ... or explicit ports, one per engine (not with base_port)
    supervisor_port = 31100   # 0: ephemeral
    front_door_port = 30000   # one OpenAI/SGLang port routing to every engine
                              # (fleet/front_door.py); 0: ephemeral; absent or -1: none
    warmup = "sequential"     # "parallel" | "sequential": how engines precompile
    max_request_bytes = 8388608  # every server (engines and supervisor): a larger body
                              # is refused with 413 before it is parsed (default 8 MiB)
    enable_memory_saver = false  # sglang's server argument, reported by every
                              # /get_server_info as set (memory release works either way)
    tool_call_parser = "hermes"  # engine servers: the tool-call format (default: chosen
                              # from the chat template, else hermes)
    reasoning_parser = "qwen3"   # engine servers: split <think> reasoning (default: none)
    chat_template = "t.jinja"    # engine servers: a chat template file replacing the
                              # model's (relative to the config file)

    [engine]                  # any EngineConfig field, shared by every engine
    page_size = 16            # (not model_path / served_model_name: see [model];
    ...                       #  not device_indexes: see [[engines]]; SGLang's
                              #  context_length is max_context_len)

    [[engines]]               # one table per engine, in order (engine 0, 1, ...)
    device_indexes = [0, 1]   # required; order kept (tensor-parallel mesh order)
    max_running_requests = 32 # any [engine] key, overriding it for this engine only

For `int | None` fields (max_total_tokens, max_context_len) the string "auto" means None
(size from device memory / from the model). Every error is a `ConfigError` whose
`field` is the dotted path of the offending key, e.g. `engines[1].device_indexes`.
"""

from __future__ import annotations

import tomllib
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from multiserve.config import (
    ConfigError,
    EngineConfig,
    FleetConfig,
    MultiHostConfig,
    ServerConfig,
)

PLATFORMS = ("cpu", "auto", "tpu", "gpu")
WARMUP_MODES = ("parallel", "sequential")
DEFAULT_BASE_PORT = 31000
DEFAULT_SUPERVISOR_PORT = 31100

_TOP_KEYS = ("model", "fleet", "engine", "engines")
_MODEL_KEYS = ("path", "served_model_name")
# [fleet] keys of one engine across hosts (SGLang's names; MultiHostConfig's fields)
MULTIHOST_KEYS = ("nnodes", "node_rank", "dist_init_addr", "heartbeat_timeout_s",
                  "startup_timeout_s")
_FLEET_KEYS = ("platform", "host", "base_port", "ports", "supervisor_port", "front_door_port",
               "warmup",
               "max_request_bytes", "enable_memory_saver", "tool_call_parser",
               "reasoning_parser", "chat_template", *MULTIHOST_KEYS)
# EngineConfig fields that are set elsewhere in the file, never in [engine]/[[engines]].
_ENGINE_FIELDS_ELSEWHERE = {
    "model_path": "set it as [model] path",
    "served_model_name": "set it as [model] served_model_name",
    "invariance_plan": "it is calibrated on each machine at start-up (`multiserve doctor` "
                       "prints it); a plan can be pinned from Python only",
}
_ENGINE_TYPES: dict[str, Any] = typing.get_type_hints(EngineConfig)
# SGLang's server-argument names accepted in [engine] / [[engines]] for our fields (its
# mem_fraction_static, max_running_requests, chunked_prefill_size, page_size and dtype
# are our names already)
ENGINE_KEY_ALIASES = {"context_length": "max_context_len"}


def load_fleet_config(path: str | Path,
                      overrides: Mapping[str, Any] | None = None) -> FleetConfig:
    """Read a fleet config file, apply `overrides`, validate, build the FleetConfig.

    `overrides` has the file's shape (`{"fleet": {"base_port": 0}}`) or dotted keys
    (`{"fleet.base_port": 0, "engine.warmup": False}`); tables merge key by key,
    anything else (including the `engines` list) replaces what the file says. Overriding
    one of `fleet.base_port` / `fleet.ports` drops the other from the file, and a
    relative `model.path` override is relative to the current directory (it comes from
    a command line), not to the file.
    """
    path = Path(path).expanduser()
    try:
        with path.open("rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError("config", f"no such file: {path}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError("config", f"{path} is not valid TOML: {e}") from None
    if overrides:
        extra = _expand_dotted(overrides)
        fleet_extra = extra.get("fleet")
        if isinstance(fleet_extra, dict) and isinstance(data.get("fleet"), dict):
            for given, dropped in (("base_port", "ports"), ("ports", "base_port")):
                if given in fleet_extra and dropped not in fleet_extra:
                    data["fleet"].pop(dropped, None)
        model_extra = extra.get("model")
        if isinstance(model_extra, dict) and isinstance(model_extra.get("path"), str) \
                and model_extra["path"] != "default":
            model_extra["path"] = str(Path(model_extra["path"]).expanduser().absolute())
        data = _merge(data, extra)
    return fleet_config_from_dict(data, base_dir=path.parent)


def fleet_config_from_dict(data: Mapping[str, Any], base_dir: Path | None = None) -> FleetConfig:
    """Build a FleetConfig from the parsed TOML document (see the module docstring)."""
    _check_keys(data, _TOP_KEYS, "")
    model = _table(data, "model")
    fleet = _table(data, "fleet")
    shared = _table(data, "engine")
    _check_keys(model, _MODEL_KEYS, "model")
    _check_keys(fleet, _FLEET_KEYS, "fleet")

    model_path = _model_path(model.get("path"), base_dir)
    name = model.get("served_model_name")
    _expect(name is None or isinstance(name, str), "model.served_model_name", "a string", name)
    common: dict[str, Any] = {"model_path": model_path, "served_model_name": name}
    if "device_indexes" in shared:
        raise ConfigError("engine.device_indexes", "set it per engine, in [[engines]]")
    common.update(_engine_fields(shared, "engine"))

    raw_engines = data.get("engines")
    if raw_engines is None:
        raise ConfigError("engines", "no [[engines]] tables: a fleet needs at least one engine")
    _expect(isinstance(raw_engines, list) and all(isinstance(t, dict) for t in raw_engines),
            "engines", "an array of tables ([[engines]])", raw_engines)
    engines = tuple(_build_engine(i, t, common, shared) for i, t in enumerate(raw_engines))
    if not engines:
        raise ConfigError("engines", "no [[engines]] tables: a fleet needs at least one engine")

    platform = fleet.get("platform", "auto")
    _expect(platform in PLATFORMS, "fleet.platform", f"one of {PLATFORMS}", platform)
    warmup = fleet.get("warmup", "sequential")
    _expect(warmup in WARMUP_MODES, "fleet.warmup", f"one of {WARMUP_MODES}", warmup)
    host = fleet.get("host", "127.0.0.1")
    _expect(isinstance(host, str) and host != "", "fleet.host", "a non-empty string", host)
    ports, port_field = _engine_ports(fleet, len(engines))
    sup_port = fleet.get("supervisor_port", DEFAULT_SUPERVISOR_PORT)
    _check_port(sup_port, "fleet.supervisor_port")
    if sup_port != 0 and sup_port in ports:
        raise ConfigError("fleet.supervisor_port",
                          f"port {sup_port} is also engines[{ports.index(sup_port)}]'s port "
                          f"(from {port_field})")
    options = _server_options(fleet)
    engine_options = _engine_server_options(fleet, base_dir)
    door_port = fleet.get("front_door_port", -1)
    if door_port != -1:
        _check_port(door_port, "fleet.front_door_port")
        if door_port != 0 and door_port in (*ports, sup_port):
            raise ConfigError("fleet.front_door_port",
                              f"port {door_port} is also an engine's or the supervisor's")
    return FleetConfig(
        engines=engines,
        servers=tuple(ServerConfig(host=host, port=p, **options, **engine_options)
                      for p in ports),
        supervisor=ServerConfig(host=host, port=sup_port, **options),
        front_door=(ServerConfig(host=host, port=door_port, **options)
                    if door_port != -1 else None),
        platform=platform,
        warmup_parallel=warmup == "parallel",
        multihost=_multihost(fleet),
    )


def _multihost(fleet: Mapping[str, Any]) -> MultiHostConfig:
    """The [fleet] keys of a slice of several hosts (MultiHostConfig validates them)."""
    given = {k: fleet[k] for k in MULTIHOST_KEYS if k in fleet}
    for key in ("nnodes", "node_rank"):
        if key in given:
            _expect(isinstance(given[key], int) and not isinstance(given[key], bool),
                    f"fleet.{key}", "an integer", given[key])
    try:
        return MultiHostConfig(**given)
    except ConfigError as e:
        raise ConfigError(f"fleet.{e.field}", str(e).split("': ", 1)[-1]) from None


def _server_options(fleet: Mapping[str, Any]) -> dict[str, Any]:
    """The [fleet] keys every server (engines and supervisor) shares, type-checked."""
    out: dict[str, Any] = {}
    if "max_request_bytes" in fleet:
        value = fleet["max_request_bytes"]
        _expect(isinstance(value, int) and not isinstance(value, bool) and value >= 1024,
                "fleet.max_request_bytes", "an integer >= 1024 (bytes)", value)
        out["max_request_bytes"] = value
    if "enable_memory_saver" in fleet:
        value = fleet["enable_memory_saver"]
        _expect(isinstance(value, bool), "fleet.enable_memory_saver", "true or false", value)
        out["enable_memory_saver"] = value
    return out


def _engine_server_options(fleet: Mapping[str, Any], base_dir: Path | None) -> dict[str, Any]:
    """The [fleet] keys only engine servers use (parsers, chat template), type-checked;
    a relative chat_template path is relative to `base_dir`."""
    out: dict[str, Any] = {}
    for key in ("tool_call_parser", "reasoning_parser", "chat_template"):
        if key in fleet:
            value = fleet[key]
            _expect(isinstance(value, str) and value != "", f"fleet.{key}", "a non-empty string",
                    value)
            out[key] = value
    if "chat_template" in out:
        p = Path(out["chat_template"]).expanduser()
        if not p.is_absolute() and base_dir is not None:
            p = base_dir / p
        out["chat_template"] = str(p)
    return out


def validate_against_devices(cfg: FleetConfig, num_devices: int) -> None:
    """Raise ConfigError naming `engines[i].device_indexes` if a device does not exist."""
    for i, eng in enumerate(cfg.engines):
        missing = [d for d in eng.device_indexes if d >= num_devices]
        if missing:
            raise ConfigError(f"engines[{i}].device_indexes",
                              f"device {missing[0]} does not exist: this host has "
                              f"{num_devices} device(s), indexes 0..{num_devices - 1}")


# --- pieces ---------------------------------------------------------------------------------

def _build_engine(i: int, table: dict[str, Any], common: dict[str, Any],
                  shared: Mapping[str, Any]) -> EngineConfig:
    where = f"engines[{i}]"
    if "device_indexes" not in table:
        raise ConfigError(f"{where}.device_indexes", "required: the devices this engine runs on")
    devs = table["device_indexes"]
    _expect(isinstance(devs, list) and len(devs) > 0
            and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in devs),
            f"{where}.device_indexes", "a non-empty list of device indexes (integers >= 0)", devs)
    own = {k: v for k, v in table.items() if k != "device_indexes"}
    kwargs = {**common, **_engine_fields(own, where), "device_indexes": tuple(devs)}
    try:
        return EngineConfig(**kwargs)
    except ConfigError as e:
        source = " (set in [engine])" if e.field in shared and e.field not in own else ""
        raise ConfigError(f"{where}.{e.field}", _message_of(e) + source) from None


def _engine_fields(table: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Type-check the EngineConfig keys of one table (SGLang's names in ENGINE_KEY_ALIASES
    too); returns constructor kwargs."""
    out: dict[str, Any] = {}
    for alias, key in ENGINE_KEY_ALIASES.items():
        if alias in table and key in table:
            raise ConfigError(f"{where}.{alias}", f"give {alias} or {key}, not both")
    for given, value in table.items():
        key = ENGINE_KEY_ALIASES.get(given, given)
        name = f"{where}.{given}"
        if key in _ENGINE_FIELDS_ELSEWHERE:
            raise ConfigError(name, _ENGINE_FIELDS_ELSEWHERE[key])
        if key not in _ENGINE_TYPES or key == "device_indexes":
            raise ConfigError(name, f"unknown key; engine keys are: {_engine_key_list()}")
        out[key] = _coerce(value, _ENGINE_TYPES[key], name)
    return out


def _coerce(value: Any, tp: Any, name: str) -> Any:
    """Check `value` (from TOML) against a dataclass field type; convert lists to tuples."""
    args = typing.get_args(tp)
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        inner = [a for a in args if a is not type(None)]
        assert len(inner) == 1, f"unsupported field type {tp} for {name}"
        if value == "auto" and inner[0] is not str:
            return None
        return _coerce(value, inner[0], name)
    if typing.get_origin(tp) is tuple:
        _expect(isinstance(value, list), name, "a list", value)
        return tuple(_coerce(v, args[0], f"{name}[{j}]") for j, v in enumerate(value))
    if tp is bool:
        _expect(isinstance(value, bool), name, "true or false", value)
    elif tp is int:
        _expect(isinstance(value, int) and not isinstance(value, bool), name, "an integer", value)
    elif tp is float:
        _expect(isinstance(value, (int, float)) and not isinstance(value, bool),
                name, "a number", value)
        return float(value)
    elif tp is str:
        _expect(isinstance(value, str), name, "a string", value)
    else:
        raise AssertionError(f"unsupported field type {tp} for {name}")
    return value


def _engine_ports(fleet: Mapping[str, Any], n: int) -> tuple[list[int], str]:
    if "ports" in fleet:
        if "base_port" in fleet:
            raise ConfigError("fleet.ports", "give either ports or base_port, not both")
        ports = fleet["ports"]
        _expect(isinstance(ports, list), "fleet.ports", "a list of port numbers", ports)
        if len(ports) != n:
            raise ConfigError("fleet.ports", f"has {len(ports)} ports for {n} engines")
        for j, p in enumerate(ports):
            _check_port(p, f"fleet.ports[{j}]")
        for j, p in enumerate(ports):
            if p != 0 and ports.index(p) != j:
                raise ConfigError(f"fleet.ports[{j}]", f"port clash: {p} is also "
                                  f"engines[{ports.index(p)}]'s port")
        return list(ports), "fleet.ports"
    base = fleet.get("base_port", DEFAULT_BASE_PORT)
    _check_port(base, "fleet.base_port")
    if base == 0:
        return [0] * n, "fleet.base_port"
    if base + n - 1 > 65535:
        raise ConfigError("fleet.base_port", f"{base} + {n} engines runs past port 65535")
    return [base + i for i in range(n)], "fleet.base_port"


def _check_port(p: Any, name: str) -> None:
    _expect(isinstance(p, int) and not isinstance(p, bool) and 0 <= p <= 65535,
            name, "a port number in [0, 65535]", p)


def _model_path(raw: Any, base_dir: Path | None) -> str | None:
    if raw is None or raw == "default":
        return None
    _expect(isinstance(raw, str) and raw != "", "model.path",
            'a path string (or "default")', raw)
    p = Path(raw).expanduser()
    if not p.is_absolute() and base_dir is not None:
        p = base_dir / p
    return str(p)


def _table(data: Mapping[str, Any], key: str) -> dict[str, Any]:
    value = data.get(key, {})
    _expect(isinstance(value, dict), key, f"a table ([{key}])", value)
    return value


def _check_keys(table: Mapping[str, Any], allowed: tuple[str, ...], where: str) -> None:
    for key in table:
        if key not in allowed:
            name = f"{where}.{key}" if where else key
            raise ConfigError(name, f"unknown key; allowed here: {', '.join(allowed)}")


def _expect(ok: bool, name: str, wanted: str, got: Any) -> None:
    if not ok:
        raise ConfigError(name, f"must be {wanted}, got {got!r} ({type(got).__name__})")


def _message_of(e: ConfigError) -> str:
    text = str(e)
    prefix = f"config field '{e.field}': "
    return text[len(prefix):] if text.startswith(prefix) else text


def _engine_key_list() -> str:
    skip = set(_ENGINE_FIELDS_ELSEWHERE) | {"device_indexes"}
    return ", ".join(k for k in _ENGINE_TYPES if k not in skip)


def _expand_dotted(overrides: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in overrides.items():
        *parents, leaf = key.split(".")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(key, "override conflicts with another override")
        node[leaf] = _merge(node[leaf], value) if isinstance(node.get(leaf), dict) else value
    return out


def _merge(base: Mapping[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out
