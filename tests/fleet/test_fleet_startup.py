"""Start-up decisions that need no engine: CLI arguments -> FleetConfig, and the errors a
fleet reports before it spends time warming up (missing devices, busy ports), each naming
the config field."""

from __future__ import annotations

import argparse
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from multiserve.cli import build_parser
from multiserve.config import ConfigError
from multiserve.fleet.launch import launch_fleet
from multiserve.fleet.startup import check_ports_free, fleet_config_from_args

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_engines_without_config_is_n_single_device_engines_with_defaults() -> None:
    cfg = fleet_config_from_args(args("--engines", "3", "--port", "32000"))
    assert [e.device_indexes for e in cfg.engines] == [(0,), (1,), (2,)]
    assert [s.port for s in cfg.servers] == [32000, 32001, 32002]
    assert cfg.platform == "auto" and cfg.supervisor.port == 31100
    assert cfg.engines[0].max_running_requests == 128  # EngineConfig's default
    assert cfg.engines[0].decode_steps_per_dispatch == 1
    cfg = fleet_config_from_args(args("--engines", "2", "--decode-steps-per-dispatch", "8"))
    assert [e.decode_steps_per_dispatch for e in cfg.engines] == [8, 8]


def test_no_arguments_means_the_shipped_cpu_4_config() -> None:
    cfg = fleet_config_from_args(args())
    assert [e.device_indexes for e in cfg.engines] == [(0,), (1,), (2,), (3,)]
    assert [s.port for s in cfg.servers] == [31000, 31001, 31002, 31003]
    assert cfg.platform == "cpu"


def test_overrides_apply_on_top_of_the_config_file() -> None:
    cfg = fleet_config_from_args(args("--config", str(CONFIGS / "cpu-2x2.toml"), "--port", "0",
                                      "--supervisor-port", "0", "--host", "127.0.0.2",
                                      "--engines", "1"))
    assert [e.device_indexes for e in cfg.engines] == [(0, 1)]  # file's explicit ports dropped
    assert [(s.host, s.port) for s in cfg.servers] == [("127.0.0.2", 0)]
    assert cfg.supervisor.port == 0


def test_server_options_from_the_command_line_reach_every_server() -> None:
    cfg = fleet_config_from_args(args("--engines", "2", "--max-request-bytes", "65536",
                                      "--enable-memory-saver"))
    for server in (*cfg.servers, cfg.supervisor):
        assert server.max_request_bytes == 65536 and server.enable_memory_saver is True
    cfg = fleet_config_from_args(args("--engines", "2"))  # sglang's default: false
    assert not any(s.enable_memory_saver for s in (*cfg.servers, cfg.supervisor))
    assert {s.max_request_bytes for s in cfg.servers} == {8 * 1024 * 1024}


def test_more_engines_than_the_config_has_is_an_error() -> None:
    with pytest.raises(ConfigError) as e:
        fleet_config_from_args(args("--config", str(CONFIGS / "cpu-2x2.toml"), "--engines", "3"))
    assert e.value.field == "engines"


def test_busy_port_is_reported_before_warm_up(busy_port: int) -> None:
    cfg = fleet_config_from_args(args("--engines", "2", "--port", str(busy_port - 1),
                                      "--supervisor-port", "0"))
    with pytest.raises(ConfigError) as e:
        check_ports_free(cfg)
    assert e.value.field == "fleet.base_port/fleet.ports"
    assert f"engine 1's port {busy_port}" in str(e.value)
    cfg = fleet_config_from_args(args("--engines", "1", "--port", "0",
                                      "--supervisor-port", str(busy_port)))
    with pytest.raises(ConfigError) as e:
        launch_fleet(cfg, announce=False)
    assert e.value.field == "fleet.supervisor_port"


def test_a_device_index_this_host_lacks_is_named() -> None:
    # The suite's process has 4 virtual devices (tests/conftest.py); 5 engines need 5.
    cfg = fleet_config_from_args(args("--engines", "5", "--port", "0", "--supervisor-port", "0"))
    with pytest.raises(ConfigError) as e:
        launch_fleet(cfg, announce=False)
    assert e.value.field == "engines[4].device_indexes"
    assert "device 4 does not exist" in str(e.value)
