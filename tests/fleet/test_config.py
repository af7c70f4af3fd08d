"""Fleet config files: the shipped configs load, and every error names its field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from multiserve.config import ConfigError, FleetConfig
from multiserve.fleet.config_loader import load_fleet_config, validate_against_devices

CONFIGS = Path(__file__).resolve().parents[2] / "configs"

MINIMAL = """
[fleet]
platform = "cpu"

[[engines]]
device_indexes = [0]

[[engines]]
device_indexes = [1]
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "fleet.toml"
    path.write_text(text)
    return path


def error_of(tmp_path: Path, text: str, overrides: dict[str, Any] | None = None) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_fleet_config(write(tmp_path, text), overrides)
    return info.value


def test_every_shipped_config_loads() -> None:
    names = sorted(p.name for p in CONFIGS.glob("*.toml"))
    assert {"cpu-4.toml", "cpu-2x2.toml", "tpu-v4-8.toml", "gpu-1.toml"} <= set(names)
    for name in names:
        assert isinstance(load_fleet_config(CONFIGS / name), FleetConfig), name


def test_cpu4_is_four_single_device_engines_on_the_documented_ports() -> None:
    cfg = load_fleet_config(CONFIGS / "cpu-4.toml")
    assert [e.device_indexes for e in cfg.engines] == [(0,), (1,), (2,), (3,)]
    assert [s.port for s in cfg.servers] == [31000, 31001, 31002, 31003]
    assert cfg.supervisor.port == 31100
    assert cfg.platform == "cpu" and cfg.device_count_needed == 4
    eng = cfg.engines[0]
    assert eng.model_path is None  # the embedded default model
    assert eng.max_running_requests == 64
    assert eng.precompile_bs_paddings == (1, 2, 4, 8, 16, 32, 64)
    assert eng.precompile_token_paddings == (1, 2, 4, 8, 16, 32, 64, 256)
    assert eng.chunked_prefill_size == 256
    assert eng.max_total_tokens is None  # sized from the host (engine/base/kv_sizing.py)...
    assert eng.host_kv_max_tokens == 4096  # ...at most one max_context_len request's worth
    assert eng.fused_step_sizes == (1, 2)  # fused programs for the 1-2 client decodes only
    # a bound, not a list: other buckets (the fleet tests' one pair) stay a valid config
    other = load_fleet_config(CONFIGS / "cpu-4.toml", {
        "engine.precompile_token_paddings": [1, 64], "engine.precompile_bs_paddings": [1, 8],
        "engine.chunked_prefill_size": 64, "engine.max_running_requests": 8})
    assert other.engines[0].fused_step_sizes == (1,)
    assert all(e == eng.with_updates(device_indexes=e.device_indexes) for e in cfg.engines)


def test_cpu2x2_groups_keep_device_order() -> None:
    cfg = load_fleet_config(CONFIGS / "cpu-2x2.toml")
    assert [e.device_indexes for e in cfg.engines] == [(0, 1), (2, 3)]
    assert [s.port for s in cfg.servers] == [31000, 31001]


def test_accelerator_configs_use_bf16_and_memory_sized_kv() -> None:
    for name in ("tpu-v4-8.toml", "gpu-1.toml"):
        cfg = load_fleet_config(CONFIGS / name)
        assert all(e.dtype == "bfloat16" and e.max_total_tokens is None for e in cfg.engines)


def test_defaults_shared_engine_table_and_per_engine_override(tmp_path: Path) -> None:
    cfg = load_fleet_config(write(tmp_path, """
[model]
path = "models/tiny"
served_model_name = "tiny"
[engine]
page_size = 32
max_running_requests = 64
precompile_bs_paddings = [64]
[[engines]]
device_indexes = [3, 1]
[[engines]]
device_indexes = [0]
max_running_requests = 8
dtype = "bfloat16"
"""))
    a, b = cfg.engines
    assert a.device_indexes == (3, 1)  # order kept
    assert a.model_path == str(tmp_path / "models" / "tiny")  # relative to the file
    assert a.served_model_name == b.served_model_name == "tiny"
    assert (a.page_size, a.max_running_requests, a.dtype) == (32, 64, "auto")
    assert (b.page_size, b.max_running_requests, b.dtype) == (32, 8, "bfloat16")
    assert [s.port for s in cfg.servers] == [31000, 31001] and cfg.supervisor.port == 31100
    assert cfg.servers[0].host == "127.0.0.1" and not cfg.warmup_parallel


def test_overrides_nested_and_dotted(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL)
    cfg = load_fleet_config(path, {"fleet": {"base_port": 0, "supervisor_port": 0},
                                   "engine.warmup": False, "fleet.warmup": "parallel"})
    assert [s.port for s in cfg.servers] == [0, 0] and cfg.supervisor.port == 0
    assert cfg.warmup_parallel and not any(e.warmup for e in cfg.engines)
    assert cfg.platform == "cpu"  # untouched keys survive the merge
    err = pytest.raises(ConfigError, load_fleet_config, path, {"fleet.bse_port": 1}).value
    assert err.field == "fleet.bse_port"


@pytest.mark.parametrize("text, field", [
    # overlapping device groups
    ("[[engines]]\ndevice_indexes = [0, 1]\n[[engines]]\ndevice_indexes = [1, 2]\n",
     "engines[1].device_indexes"),
    # unknown keys, at every level
    ("[fleet]\nbase_prot = 1\n" + "[[engines]]\ndevice_indexes = [0]\n", "fleet.base_prot"),
    ("[modle]\npath = 'x'\n[[engines]]\ndevice_indexes = [0]\n", "modle"),
    ("[engine]\npage_sise = 16\n[[engines]]\ndevice_indexes = [0]\n", "engine.page_sise"),
    ("[[engines]]\ndevice_indexes = [0]\n[[engines]]\ndevice_indexes = [1]\nfoo = 1\n",
     "engines[1].foo"),
    # bad types
    ("[engine]\npage_size = '16'\n[[engines]]\ndevice_indexes = [0]\n", "engine.page_size"),
    ("[engine]\ndisable_overlap = 1\n[[engines]]\ndevice_indexes = [0]\n",
     "engine.disable_overlap"),
    ("[engine]\nprecompile_bs_paddings = [64, 'x']\n[[engines]]\ndevice_indexes = [0]\n",
     "engine.precompile_bs_paddings[1]"),
    ("[[engines]]\ndevice_indexes = 0\n", "engines[0].device_indexes"),
    ("[[engines]]\ndevice_indexes = [true]\n", "engines[0].device_indexes"),
    ("[fleet]\nbase_port = 'x'\n[[engines]]\ndevice_indexes = [0]\n", "fleet.base_port"),
    ("[fleet]\nplatform = 'cuda'\n[[engines]]\ndevice_indexes = [0]\n", "fleet.platform"),
    ("[fleet]\nwarmup = 'lazy'\n[[engines]]\ndevice_indexes = [0]\n", "fleet.warmup"),
    ("[fleet]\nmax_request_bytes = '8MB'\n[[engines]]\ndevice_indexes = [0]\n",
     "fleet.max_request_bytes"),
    ("[fleet]\nmax_request_bytes = 10\n[[engines]]\ndevice_indexes = [0]\n",
     "fleet.max_request_bytes"),
    ("[fleet]\nenable_memory_saver = 1\n[[engines]]\ndevice_indexes = [0]\n",
     "fleet.enable_memory_saver"),
    ("[model]\npath = 3\n[[engines]]\ndevice_indexes = [0]\n", "model.path"),
    # misplaced keys
    ("[engine]\nmodel_path = 'x'\n[[engines]]\ndevice_indexes = [0]\n", "engine.model_path"),
    ("[engine]\ndevice_indexes = [0]\n[[engines]]\ndevice_indexes = [0]\n",
     "engine.device_indexes"),
    # structure
    ("[fleet]\nplatform = 'cpu'\n", "engines"),
    ("[[engines]]\ndtype = 'auto'\n", "engines[0].device_indexes"),
    # values the EngineConfig rejects are named per engine
    ("[[engines]]\ndevice_indexes = [0]\n[[engines]]\ndevice_indexes = [1]\npage_size = 24\n",
     "engines[1].page_size"),
    ("[engine]\nmax_running_requests = 512\n[[engines]]\ndevice_indexes = [0]\n",
     "engines[0].precompile_bs_paddings"),
    ("[[engines]]\ndevice_indexes = [0, 0]\n", "engines[0].device_indexes"),
])
def test_errors_name_the_field(tmp_path: Path, text: str, field: str) -> None:
    err = error_of(tmp_path, text)
    assert err.field == field
    assert field in str(err)


@pytest.mark.parametrize("fleet, field", [
    ("ports = [31000, 31000]", "fleet.ports[1]"),
    ("base_port = 31099\nsupervisor_port = 31100", "fleet.supervisor_port"),
    ("ports = [31000, 31100]", "fleet.supervisor_port"),
    ("ports = [31000]", "fleet.ports"),
    ("ports = [31000, 31001]\nbase_port = 31000", "fleet.ports"),
    ("ports = [31000, 70000]", "fleet.ports[1]"),
    ("base_port = 65535", "fleet.base_port"),
])
def test_port_errors_name_the_field(tmp_path: Path, fleet: str, field: str) -> None:
    err = error_of(tmp_path, f"[fleet]\n{fleet}\n" + MINIMAL.split("[fleet]")[1]
                   .replace('platform = "cpu"', ""))
    assert err.field == field and field in str(err)


def test_port_and_model_overrides_as_a_command_line_gives_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = load_fleet_config(CONFIGS / "cpu-2x2.toml", {"fleet.base_port": 32000})
    assert [s.port for s in cfg.servers] == [32000, 32001]  # replaces the file's ports
    cfg = load_fleet_config(CONFIGS / "cpu-4.toml", {"fleet.ports": [5, 6, 7, 8]})
    assert [s.port for s in cfg.servers] == [5, 6, 7, 8]
    monkeypatch.chdir(tmp_path)
    cfg = load_fleet_config(CONFIGS / "cpu-4.toml", {"model.path": "m.gguf"})
    assert cfg.engines[0].model_path == str(tmp_path / "m.gguf")  # relative to the cwd


def test_shared_value_error_says_where_it_was_set(tmp_path: Path) -> None:
    err = error_of(tmp_path, "[engine]\npage_size = 24\n[[engines]]\ndevice_indexes = [0]\n")
    assert err.field == "engines[0].page_size" and "[engine]" in str(err)


def test_ephemeral_ports_never_clash(tmp_path: Path) -> None:
    cfg = load_fleet_config(write(tmp_path, MINIMAL), {"fleet.base_port": 0,
                                                       "fleet.supervisor_port": 0})
    assert [s.port for s in cfg.servers] == [0, 0] and cfg.supervisor.port == 0


def test_auto_means_derived_for_optional_integers(tmp_path: Path) -> None:
    cfg = load_fleet_config(write(tmp_path, "[engine]\nmax_total_tokens = 'auto'\n"
                                  "max_context_len = 'auto'\n[[engines]]\ndevice_indexes = [0]\n"))
    assert cfg.engines[0].max_total_tokens is None and cfg.engines[0].max_context_len is None


def test_file_level_errors(tmp_path: Path) -> None:
    err = pytest.raises(ConfigError, load_fleet_config, tmp_path / "missing.toml").value
    assert err.field == "config" and "missing.toml" in str(err)
    err = error_of(tmp_path, "[fleet\n")
    assert err.field == "config" and "TOML" in str(err)


def test_validate_against_devices_names_the_missing_device() -> None:
    cfg = load_fleet_config(CONFIGS / "cpu-2x2.toml")
    validate_against_devices(cfg, 4)
    with pytest.raises(ConfigError) as info:
        validate_against_devices(cfg, 3)
    assert info.value.field == "engines[1].device_indexes"
    assert "device 3 does not exist" in str(info.value)


def test_server_options_apply_to_every_server(tmp_path: Path) -> None:
    """[fleet] max_request_bytes / enable_memory_saver: every engine server and the
    supervisor; defaults 8 MiB and false (sglang's default)."""
    from multiserve.config import DEFAULT_MAX_REQUEST_BYTES

    cfg = load_fleet_config(write(tmp_path, MINIMAL))
    for server in (*cfg.servers, cfg.supervisor):
        assert server.max_request_bytes == DEFAULT_MAX_REQUEST_BYTES == 8 * 1024 * 1024
        assert server.enable_memory_saver is False
    cfg = load_fleet_config(write(tmp_path, MINIMAL.replace(
        'platform = "cpu"', 'platform = "cpu"\nmax_request_bytes = 65536\n'
        "enable_memory_saver = true")))
    for server in (*cfg.servers, cfg.supervisor):
        assert server.max_request_bytes == 65536 and server.enable_memory_saver is True
    cfg = load_fleet_config(write(tmp_path, MINIMAL), {"fleet.enable_memory_saver": True})
    assert all(s.enable_memory_saver for s in (*cfg.servers, cfg.supervisor))


def test_speculation_from_the_file_and_the_command_line(tmp_path: Path) -> None:
    from multiserve.cli import build_parser
    from multiserve.fleet.startup import fleet_config_from_args

    text = MINIMAL.replace("[[engines]]", '[engine]\nspeculative_algorithm = "ngram"\n'
                           "speculative_num_draft_tokens = 6\n\n[[engines]]", 1)
    cfg = load_fleet_config(write(tmp_path, text))
    assert all(e.speculative_algorithm == "ngram" and e.speculative_num_draft_tokens == 6
               for e in cfg.engines)
    err = error_of(tmp_path, text.replace('"ngram"', '"eagle"'))
    assert err.field == "engines[0].speculative_algorithm" and "ngram" in str(err)
    args = build_parser().parse_args(["serve", "--config", str(CONFIGS / "cpu-4.toml"),
                                      "--speculative-algorithm", "ngram",
                                      "--speculative-num-draft-tokens", "3"])
    cfg = fleet_config_from_args(args)
    assert {(e.speculative_algorithm, e.speculative_num_draft_tokens)
            for e in cfg.engines} == {("ngram", 3)}
    plain = fleet_config_from_args(build_parser().parse_args(
        ["serve", "--config", str(CONFIGS / "cpu-4.toml")]))
    assert {e.speculative_algorithm for e in plain.engines} == {None}
