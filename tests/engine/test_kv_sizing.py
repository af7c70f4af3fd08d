"""The KV pool sizing rule (engine/base/kv_sizing.py): explicit config wins, then device memory,
then the engine's share of the host's memory, capped and in whole pages. Pure functions:
no engine, no jax."""

from __future__ import annotations

import pytest

from multiserve.config import ConfigError, EngineConfig, ModelConfig
from multiserve.engine.base.kv_sizing import MIN_POOL_PAGES, host_memory_bytes, pool_tokens

GIB = 1 << 30
# SmolLM2-135M's KV shape: 30 layers x 3 KV heads x 64 dims, K and V
SMOL = ModelConfig(architecture="llama", vocab_size=49152, hidden_size=576,
                   intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3,
                   head_dim=64)
SMOL_F32_TOKEN = 2 * 30 * 3 * 64 * 4  # bytes of one float32 token's K and V


def size(cfg: EngineConfig, *, host: int = 16 * GIB, engine_devices: int = 1,
         process_devices: int = 4, device_limit: int | None = None,
         per_token: int = SMOL_F32_TOKEN, params: int = 0) -> tuple[int, str]:
    pool = pool_tokens(cfg, kv_bytes_per_token=per_token, params_bytes=params,
                       engine_devices=engine_devices, process_devices=process_devices,
                       device_bytes_limit=device_limit, host_bytes=host)
    return pool.tokens, pool.rule


def test_explicit_max_total_tokens_wins_over_every_memory() -> None:
    cfg = EngineConfig(max_total_tokens=32768)
    assert size(cfg) == (32768, "explicit")
    assert size(cfg, host=1 * GIB) == (32768, "explicit")
    assert size(cfg, device_limit=80 * GIB) == (32768, "explicit")


def test_host_rule_is_the_engines_share_of_the_fraction_in_whole_pages() -> None:
    cfg = EngineConfig(host_kv_mem_fraction=0.1, host_kv_max_tokens=1 << 20, page_size=16)
    tokens, rule = size(cfg, host=8 * GIB, process_devices=4)
    expected = int(8 * GIB * 0.1 / 4) // SMOL_F32_TOKEN // 16 * 16
    assert rule == "host memory" and tokens == expected and tokens % 16 == 0
    # a 2-device engine of the same process gets twice the share; a bigger host, more
    assert size(cfg, host=8 * GIB, engine_devices=2, process_devices=4)[0] >= 2 * tokens - 16
    assert size(cfg, host=16 * GIB, process_devices=4)[0] > tokens
    # a bfloat16 pool (half the bytes per token) holds twice the tokens
    assert size(cfg, host=8 * GIB, per_token=SMOL_F32_TOKEN // 2)[0] >= 2 * tokens - 16


def test_host_rule_is_capped_so_a_small_model_takes_no_more() -> None:
    cfg = EngineConfig(host_kv_max_tokens=8192)
    tokens, _ = size(cfg, host=512 * GIB)
    assert tokens == 8192  # not the ~300k tokens 10% of 512 GiB would hold
    # a large model's token is bigger: the same host then gives fewer tokens than the cap
    big, _ = size(cfg, host=16 * GIB, per_token=SMOL_F32_TOKEN * 20)
    assert big < 8192


def test_host_rule_never_goes_below_its_minimum_pool() -> None:
    cfg = EngineConfig(page_size=16)
    assert size(cfg, host=64 << 20, process_devices=8)[0] == MIN_POOL_PAGES * 16


def test_device_rule_takes_the_fraction_less_the_weights() -> None:
    cfg = EngineConfig(mem_fraction_static=0.5, page_size=16)
    tokens, rule = size(cfg, device_limit=16 * GIB, params=2 * GIB, per_token=1 << 16)
    assert rule == "device memory"
    assert tokens == (8 * GIB - 2 * GIB) // (1 << 16) // 16 * 16
    # two devices: each holds half the weights and half of every token
    assert size(cfg, device_limit=16 * GIB, params=2 * GIB, per_token=1 << 16,
                 engine_devices=2)[0] == (8 * GIB - GIB) // (1 << 15) // 16 * 16


def test_host_memory_is_read_and_positive() -> None:
    assert host_memory_bytes() > 64 << 20


@pytest.mark.parametrize("field,value", [("host_kv_mem_fraction", 0.0),
                                         ("host_kv_mem_fraction", 1.0),
                                         ("host_kv_max_tokens", 8)])
def test_invalid_host_fields_are_refused(field: str, value: float) -> None:
    with pytest.raises(ConfigError, match=field):
        EngineConfig(**{field: value})
