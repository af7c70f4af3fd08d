"""SGLang's server flags on `multiserve serve` / `validate` (fleet/sglang_flags.py): each
supported flag sets its field on every engine (over the file's values), an SGLang flag we do
not support is an error naming it (exit code 2), and `--mem-fraction-static` sizes the KV
pool (engine/base/kv_sizing.py `pool_tokens`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from multiserve.cli import build_parser
from multiserve.config import ConfigError, FleetConfig
from multiserve.fleet.config_loader import load_fleet_config
from multiserve.fleet.startup import fleet_config_from_args

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def cfg_of(*argv: str, command: str = "serve") -> FleetConfig:
    return fleet_config_from_args(build_parser().parse_args([command, *argv]))


@pytest.mark.parametrize("command", ["serve", "validate"])
def test_each_flag_sets_its_field_on_every_engine(command: str) -> None:
    cfg = cfg_of("--config", str(CONFIGS / "cpu-4.toml"), "--mem-fraction-static", "0.5",
                 "--context-length", "1024", "--max-running-requests", "16",
                 "--chunked-prefill-size", "256", "--page-size", "32", "--dtype", "half",
                 "--served-model-name", "policy", "--model-path", "default",
                 command=command)
    assert len(cfg.engines) == 4
    for e in cfg.engines:
        assert (e.mem_fraction_static, e.max_context_len, e.max_running_requests,
                e.chunked_prefill_size, e.page_size, e.dtype, e.served_model_name,
                e.model_path) == (0.5, 1024, 16, 256, 32, "float16", "policy", None)
    plain = cfg_of("--config", str(CONFIGS / "cpu-4.toml"))
    default = load_fleet_config(CONFIGS / "cpu-4.toml")
    assert plain.engines == default.engines  # no flag: the file decides
    assert default.engines[0].mem_fraction_static is None  # the default rule


def test_enable_return_routed_experts_flag_and_config_key(tmp_path: Path) -> None:
    """SGLang's --enable-return-routed-experts sets the option on every engine; the fleet
    file's key is the EngineConfig field; not given, the engines do not capture."""
    on = cfg_of("--config", str(CONFIGS / "cpu-4.toml"), "--enable-return-routed-experts")
    assert [e.enable_return_routed_experts for e in on.engines] == [True] * 4
    assert not any(e.enable_return_routed_experts for e in cfg_of("--engines", "2").engines)
    path = tmp_path / "f.toml"
    path.write_text('[fleet]\nplatform = "cpu"\n[engine]\nenable_return_routed_experts = '
                    "true\n[[engines]]\ndevice_indexes = [0]\n")
    assert load_fleet_config(path).engines[0].enable_return_routed_experts


def test_model_path_is_models_alias(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    a = build_parser().parse_args(["serve", "--model-path", "m.gguf"])
    b = build_parser().parse_args(["serve", "--model", "m.gguf"])
    assert a.model == b.model == "m.gguf"
    assert cfg_of("--model-path", "m.gguf").engines[0].model_path == str(tmp_path / "m.gguf")


def test_dtype_names(tmp_path: Path) -> None:
    for given, field in (("float", "float32"), ("half", "float16"), ("bfloat16", "bfloat16"),
                         ("auto", "auto")):
        assert cfg_of("--engines", "1", "--dtype", given).engines[0].dtype == field
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--dtype", "int8"])


def test_flags_win_over_the_files_engine_and_engines_tables(tmp_path: Path) -> None:
    path = tmp_path / "f.toml"
    path.write_text('[fleet]\nplatform = "cpu"\n[engine]\ncontext_length = 512\n'
                    "page_size = 8\n[[engines]]\ndevice_indexes = [0]\nmax_context_len = 256\n"
                    "[[engines]]\ndevice_indexes = [1]\n")
    from_file = load_fleet_config(path)
    assert [e.max_context_len for e in from_file.engines] == [256, 512]  # SGLang's name too
    cfg = cfg_of("--config", str(path), "--context-length", "2048", "--page-size", "64")
    assert [(e.max_context_len, e.page_size) for e in cfg.engines] == [(2048, 64)] * 2
    path.write_text("[engine]\ncontext_length = 512\nmax_context_len = 512\n"
                    "[[engines]]\ndevice_indexes = [0]\n")
    with pytest.raises(ConfigError) as info:
        load_fleet_config(path)
    assert info.value.field == "engine.context_length"


def test_tp_size_is_devices_per_engine() -> None:
    assert [e.device_indexes for e in cfg_of("--tp-size", "2").engines] == [(0, 1)]
    assert [e.device_indexes for e in cfg_of("--tp-size", "2", "--engines", "2").engines] == [
        (0, 1), (2, 3)]
    cfg = cfg_of("--config", str(CONFIGS / "cpu-2x2.toml"), "--tp-size", "2")
    assert all(len(e.device_indexes) == 2 for e in cfg.engines)
    with pytest.raises(ConfigError) as info:
        cfg_of("--config", str(CONFIGS / "cpu-4.toml"), "--tp-size", "2")
    assert info.value.field == "tp_size" and "engines[0]" in str(info.value)
    with pytest.raises(ConfigError) as info:
        cfg_of("--tp-size", "0")
    assert info.value.field == "tp_size"


def test_out_of_range_values_name_the_field() -> None:
    with pytest.raises(ConfigError) as info:
        cfg_of("--engines", "1", "--mem-fraction-static", "1.5")
    assert info.value.field == "engines[0].mem_fraction_static"
    with pytest.raises(ConfigError) as info:
        cfg_of("--engines", "1", "--page-size", "24")
    assert info.value.field == "engines[0].page_size"


@pytest.mark.parametrize("command", ["serve", "validate"])
@pytest.mark.parametrize("argv, named", [
    (["--quantization", "fp8"], "unsupported SGLang flag --quantization"),
    (["--dp-size", "2"], "unsupported SGLang flag --dp-size"),
    (["--trust-remote-code"], "unsupported SGLang flag --trust-remote-code"),
    (["--enable-torch-compile"], "unsupported SGLang flag --enable-torch-compile"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
])
def test_unsupported_flags_are_errors_naming_them(capsys: pytest.CaptureFixture[str],
                                                  command: str, argv: list[str],
                                                  named: str) -> None:
    from multiserve.cli import main

    with pytest.raises(SystemExit) as info:
        main([command, "--engines", "1", *argv])
    assert info.value.code == 2
    assert named in capsys.readouterr().err


def test_lora_flags_set_the_engines_lora_fields(tmp_path: Path) -> None:
    plain = cfg_of("--engines", "2").engines[0]
    assert (plain.max_loras_per_batch, plain.lora_paths) == (0, ())  # LoRA off
    cfg = cfg_of("--engines", "2", "--lora-paths", f"a={tmp_path / 'a'}", "b",
                 "--max-lora-rank", "32")
    for e in cfg.engines:
        assert e.lora_paths == (f"a={tmp_path / 'a'}", f"b={Path('b').resolve()}")
        assert (e.max_loras_per_batch, e.max_lora_rank) == (8, 32)  # SGLang's default 8
    e = cfg_of("--engines", "1", "--enable-lora", "--max-loras-per-batch", "3").engines[0]
    assert (e.max_loras_per_batch, e.lora_paths) == (3, ())
    assert cfg_of("--engines", "1", "--enable-lora").engines[0].max_loras_per_batch == 8
    with pytest.raises(ConfigError) as info:
        cfg_of("--engines", "1", "--lora-paths", "a=x", "b=y", "--max-loras-per-batch", "1")
    assert info.value.field == "engines[0].lora_paths"


def test_mem_fraction_static_sizes_the_kv_pool() -> None:
    """None: the default rule (DEFAULT_MEM_FRACTION of a reporting device; on the host
    host_kv_mem_fraction of its memory, capped at host_kv_max_tokens); given: that share of
    the device's memory, or of the host's memory less the weights, capped at
    max_running_requests full contexts (engine/base/kv_sizing.py)."""
    from multiserve.config import DEFAULT_MEM_FRACTION, EngineConfig
    from multiserve.engine.base.kv_sizing import pool_tokens

    per = 1000  # KV bytes per token

    def size(cfg: EngineConfig, limit: int | None = None, host: int = 0, params: int = 0,
             context: int = 512) -> int:
        return pool_tokens(cfg, kv_bytes_per_token=per, params_bytes=params, engine_devices=1,
                           process_devices=1, device_bytes_limit=limit, host_bytes=host,
                           context_len=context).tokens

    base = EngineConfig(max_context_len=512, max_running_requests=4, precompile_bs_paddings=(4,))
    assert base.mem_fraction_static is None
    assert size(base, limit=100_000 * per, params=96 * per) == \
        (int(DEFAULT_MEM_FRACTION * 100_000) - 96) // 16 * 16
    assert size(base.with_updates(mem_fraction_static=0.5), limit=100_000 * per) == 50_000
    assert size(base, host=10**12) == base.host_kv_max_tokens
    # the host: 4 contexts of 512 tokens are all it may need
    frac = base.with_updates(mem_fraction_static=0.5)
    assert size(frac, host=10**12) == 4 * 512
    # ... or the fraction less the weights, where that is less
    wide = frac.with_updates(max_running_requests=64, precompile_bs_paddings=(64,))
    assert size(wide, host=20_000 * per, params=2_000 * per, context=1 << 20) == 8_000
