"""Builds the parts of one engine: model + tokenizer, devices, KV sizing, runner, core.

Owns the start-up decisions: which devices (by index into `jax.devices()`, whatever the
platform), the compute dtype ("auto": dtype_choice.py), the KV pool size (explicit
tokens, else a fraction of the device's or the host's memory: kv_sizing.py states the
rule, `kv_pool_size` applies it) and the context length (model limit, config limit, and
what the pool can hold).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from multiserve.config import ConfigError, EngineConfig, ModelConfig
from multiserve.engine.base.dtype_choice import DtypeChoice, choose_dtype
from multiserve.engine.base.kv_sizing import PoolSize, host_memory_bytes, pool_tokens
from multiserve.engine.base.stop_strings import StopStringChecker
from multiserve.engine.core import EngineCore
from multiserve.engine.device.runner import Runner
from multiserve.host.heap import release_free_heap
from multiserve.model.kernels import native as native_kernels
from multiserve.model.layers.kv_pool import kv_bytes_per_token
from multiserve.model.loading.loader import load_model, resolve_model_dir
from multiserve.multihost.link import LeaderLink
from multiserve.multihost.session import EngineStart, spans_hosts
from multiserve.multihost.session import current as current_session


@dataclass
class EngineParts:
    model_cfg: ModelConfig
    runner: Runner
    core: EngineCore
    tokenizer: Any
    tokenizer_dir: Path
    model_path: Path
    model_name: str
    kv_pool: PoolSize  # how the KV pool's size was chosen (get_internal_state "memory")


def resolve_devices(indexes: tuple[int, ...]) -> list[jax.Device]:
    devices = jax.devices()
    for i in indexes:
        if i >= len(devices):
            raise ConfigError("device_indexes",
                              f"device {i} does not exist ({len(devices)} "
                              f"{devices[0].platform} device(s) visible)")
    return [devices[i] for i in indexes]


def resolve_dtype(cfg: EngineConfig, devices: list[jax.Device],
                  model_dir: Path | None) -> DtypeChoice:
    """The engine's compute dtype and why (dtype_choice.py); `model_dir` the checkpoint
    (None: the embedded default model)."""
    platform = devices[0].platform
    unavailable = (native_kernels.unavailable_reason("bfloat16") if platform == "cpu"
                   and cfg.dtype == "auto" else None)
    paths = (", ".join(native_kernels.bf16_path_candidates()) if unavailable is None
             else None)
    return choose_dtype(cfg.dtype, platform, model_dir, unavailable, paths)


def kv_pool_size(cfg: EngineConfig, model_cfg: ModelConfig, devices: list[jax.Device],
                 dtype: Any, params_bytes: int) -> PoolSize:
    """The engine's KV pool (engine/base/kv_sizing.py states the rule) on `devices`."""
    stats = None
    if cfg.max_total_tokens is None:
        try:
            stats = devices[0].memory_stats()
        except Exception:  # noqa: BLE001 - not every backend reports memory
            stats = None
    # the pool's bytes as it will be held: on a TPU the "lanes" layout's padded rows (an
    # upper bound there: a plan that runs XLA's attention keeps "heads", never larger)
    layout = "lanes" if devices[0].platform == "tpu" else "heads"
    return pool_tokens(cfg, kv_bytes_per_token=kv_bytes_per_token(model_cfg, dtype, layout),
                       params_bytes=params_bytes, engine_devices=len(devices),
                       process_devices=len(jax.devices(devices[0].platform)),
                       device_bytes_limit=(stats or {}).get("bytes_limit"),
                       host_bytes=host_memory_bytes(),
                       context_len=cfg.max_context_len or model_cfg.max_position_embeddings)


# transformers resolves its lazy attributes on first use, and that is not thread-safe:
# engines warming up in parallel threads must not import/load tokenizers at once.
_TOKENIZER_LOCK = threading.Lock()


def load_tokenizer(tokenizer_dir: Path) -> Any:
    with _TOKENIZER_LOCK:
        from transformers import PreTrainedTokenizerFast  # tokenizers-backed: no torch

        return PreTrainedTokenizerFast.from_pretrained(str(tokenizer_dir))


def build_engine_parts(cfg: EngineConfig, progress: Any = None) -> EngineParts:
    devices = resolve_devices(cfg.device_indexes)
    leader = _spanning_leader(cfg, devices)
    if leader is not None:
        # every host primes the same programs in the same order: all compiled before serving;
        # one decode step a dispatch (a follower replays single steps: multihost/ops.py)
        cfg = cfg.with_updates(compile_in_background=False, decode_steps_per_dispatch=1)
    model_dir = None if cfg.model_path is None else resolve_model_dir(cfg.model_path)
    choice = resolve_dtype(cfg, devices, model_dir)
    dtype = jnp.dtype(choice.dtype)
    # loaded in the compute dtype: a bfloat16 checkpoint's bits go to the device as they are
    loaded = load_model(model_dir if model_dir is not None else None, dtype.name)
    model_cfg = loaded.config
    params_bytes = sum(np.asarray(a).size for a in jax.tree.leaves(loaded.params)) * \
        np.dtype(dtype).itemsize
    pool = kv_pool_size(cfg, model_cfg, devices, dtype, params_bytes)
    num_pages = pool.tokens // cfg.page_size + 1  # + page 0 (padding sink)
    limits = [model_cfg.max_position_embeddings, (num_pages - 1) * cfg.page_size]
    if cfg.max_context_len is not None:
        limits.append(cfg.max_context_len)
    max_context = min(limits)
    on_calibrated = None
    if leader is not None:
        def on_calibrated(calibration: Any) -> Any:
            # before the runner's first device op: the followers build the same runner
            leader.send(EngineStart(calibration.plan, dtype.name, pool.tokens))
            return calibration
    runner = Runner(cfg, model_cfg, loaded.params, devices, num_pages, dtype,
                    dtype_choice=choice, on_calibrated=on_calibrated)
    if cfg.warmup:
        _warmup(runner, cfg, max_context, progress)
    if leader is not None:
        runner.mirror = leader.send  # from now on every device op reaches the followers
    tokenizer = load_tokenizer(loaded.tokenizer_dir)
    eos = set(model_cfg.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        eos.add(int(tokenizer.eos_token_id))
    core = EngineCore(cfg, model_cfg, runner, num_pages, max_context, sorted(eos),
                      stop_string_checker=StopStringChecker(tokenizer))
    name = Path(loaded.path).name if loaded.path else "model"
    if cfg.model_path is None:
        name = "SmolLM2-135M-Instruct"
    return EngineParts(model_cfg, runner, core, tokenizer, Path(loaded.tokenizer_dir),
                       Path(loaded.path), name, pool)


def _spanning_leader(cfg: EngineConfig, devices: list[jax.Device]) -> LeaderLink | None:
    """The step stream of an engine spanning hosts when this process leads the slice, else
    None. Such an engine must warm up (no program may compile on the step path)."""
    session = current_session()
    if session is None or session.leader is None or not spans_hosts(devices):
        return None  # one host's engine, or a follower's copy (fleet/follower.py)
    if not cfg.warmup:
        raise ConfigError("warmup", "an engine spanning hosts must warm up (every host "
                          "compiles the same programs before serving)")
    if cfg.max_loras_per_batch > 0:
        raise ConfigError("max_loras_per_batch", "LoRA adapters are not streamed to the "
                          "other hosts yet: an engine spanning hosts runs without LoRA")
    return session.leader


def _warmup(runner: Runner, cfg: EngineConfig, max_context: int, progress: Any) -> None:
    """Compile the step programs (engine/device/programs.py); returns once the engine can
    serve. `progress(kind, size)` hears of every program, including those compiled later
    in the background (on that thread); the bar counts the ones compiled before serving."""
    max_pages = -(-max_context // cfg.page_size)
    bar = None
    if cfg.show_progress and progress is None:
        from tqdm import tqdm

        first = runner.step_programs.warmup_plan(cfg.compile_in_background).first
        bar = tqdm(total=len(first), desc=f"compile engine {list(cfg.device_indexes)}",
                   leave=False)
    t0 = time.monotonic()
    serving = threading.Event()

    def tick(kind: str, size: int) -> None:
        if bar is not None and not serving.is_set():
            bar.set_postfix_str(f"{kind}={size}")
            bar.update(1)
        if progress is not None:
            progress(kind, size)

    def first_ready() -> None:
        serving.set()
        if bar is not None:
            bar.close()

    runner.step_programs.warmup(max_pages, tick, background=cfg.compile_in_background,
                                on_complete=release_free_heap, on_first=first_ready)
    runner.warmup_seconds = time.monotonic() - t0
