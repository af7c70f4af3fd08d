"""How many tokens an engine's KV pool holds when the config does not say (`max_total_tokens`
unset or "auto"): the one rule, as pure functions of the model, the memory and the config.

The rule (`pool_tokens`), first that applies:
1. `max_total_tokens` given: that many tokens (explicit config always wins).
2. The device reports its memory (accelerators, `memory_stats()["bytes_limit"]`):
   `mem_fraction_static` (SGLang's flag; None: DEFAULT_MEM_FRACTION) of it, less this
   device's share of the weights, in tokens (at least 64 pages).
3. Host memory (CPU devices report none; `host_memory_bytes`: physical memory, or the
   cgroup's limit where lower), the engine's share of it: split over the process's devices
   in proportion to the engine's device count (a fleet of 4 one-device engines gives each a
   quarter). Of that share, `host_kv_mem_fraction`, capped at `host_kv_max_tokens` (a small
   model's pool stops there instead of taking GBs it never fills); or, where
   `mem_fraction_static` is given (SGLang's meaning: weights + KV), that fraction less the
   engine's weights, capped at what `max_running_requests` full contexts need. At least 64
   pages either way.

Tokens are whole pages. The rule reads only stable quantities (physical memory, device
counts), never the memory free at the moment: the engines of one fleet get the same pool,
hence the same program shapes, which they then share (engine/device/program_share.py).

Invariant: nothing here imports jax (tests call it with plain numbers).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from multiserve.config import DEFAULT_MEM_FRACTION, EngineConfig

MIN_POOL_PAGES = 64  # the smallest pool either memory rule gives
CGROUP_MEMORY_MAX = Path("/sys/fs/cgroup/memory.max")  # cgroup v2: "max" or bytes


@dataclass(frozen=True)
class PoolSize:
    """An engine's KV pool: `tokens` (whole pages, page 0 excluded) and how they were
    chosen (`rule`: "explicit", "device memory" or "host memory"; `budget_bytes`: the
    bytes the memory rule allowed, None when explicit). Reported by get_internal_state."""

    tokens: int
    rule: str
    budget_bytes: int | None = None


def host_memory_bytes() -> int:
    """The memory this process can have: the host's physical memory, or its cgroup's
    limit where one is set and lower. 0 where neither can be read."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 0
    try:
        limit = CGROUP_MEMORY_MAX.read_text().strip()
    except OSError:
        limit = "max"
    if limit.isdigit() and (total <= 0 or int(limit) < total):
        return int(limit)
    return max(0, total)


def _whole_pages(tokens: float, page_size: int) -> int:
    return max(MIN_POOL_PAGES, int(tokens) // page_size) * page_size


def device_pool(cfg: EngineConfig, bytes_limit: int, device_count: int, params_bytes: int,
                kv_bytes_per_token: int) -> PoolSize:
    """Rule 2: `bytes_limit` is one device's memory; the engine's `device_count` devices
    hold the weights (`params_bytes` in all) and the pool (`kv_bytes_per_token` in all),
    each an equal share."""
    fraction = DEFAULT_MEM_FRACTION if cfg.mem_fraction_static is None \
        else cfg.mem_fraction_static
    budget = bytes_limit * fraction - params_bytes / device_count
    per_token = kv_bytes_per_token / device_count
    return PoolSize(_whole_pages(budget / per_token, cfg.page_size), "device memory",
                    int(budget * device_count))


def host_pool(cfg: EngineConfig, host_bytes: int, engine_devices: int, process_devices: int,
              kv_bytes_per_token: int, params_bytes: int = 0, context_len: int = 0) -> PoolSize:
    """Rule 3: of the engine's share of `host_bytes` (its `engine_devices` of the process's
    `process_devices`), `host_kv_mem_fraction` capped at `host_kv_max_tokens`; or, with
    `mem_fraction_static` given, that fraction less the engine's weights (`params_bytes`),
    capped at `max_running_requests` contexts of `context_len` tokens."""
    share = host_bytes * engine_devices / max(1, process_devices)
    if cfg.mem_fraction_static is None:
        budget = int(share * cfg.host_kv_mem_fraction)
        cap = cfg.host_kv_max_tokens
    else:
        budget = max(0, int(share * cfg.mem_fraction_static - params_bytes))
        cap = cfg.max_running_requests * context_len
    tokens = min(budget // kv_bytes_per_token, cap)
    return PoolSize(_whole_pages(tokens, cfg.page_size), "host memory", budget)


def pool_tokens(cfg: EngineConfig, *, kv_bytes_per_token: int, params_bytes: int,
                engine_devices: int, process_devices: int, device_bytes_limit: int | None,
                host_bytes: int, context_len: int = 0) -> PoolSize:
    """The rule of the module docstring. `kv_bytes_per_token`: K and V of one token over
    every layer, in the pool's dtype; `device_bytes_limit`: one device's memory where it
    reports it (None: a host device); `context_len`: the engine's context (rule 3 with
    `mem_fraction_static`)."""
    if cfg.max_total_tokens is not None:
        return PoolSize(cfg.max_total_tokens, "explicit")
    if device_bytes_limit:
        return device_pool(cfg, device_bytes_limit, engine_devices, params_bytes,
                           kv_bytes_per_token)
    return host_pool(cfg, host_bytes, engine_devices, process_devices, kv_bytes_per_token,
                     params_bytes, context_len)
