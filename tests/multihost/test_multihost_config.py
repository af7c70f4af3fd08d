"""The slice's configuration: MultiHostConfig's validation, the [fleet] keys, and SGLang's
--nnodes / --node-rank / --dist-init-addr on `multiserve serve` (no process started)."""

from __future__ import annotations

from pathlib import Path

import pytest

from multiserve.cli import build_parser
from multiserve.config import ConfigError, MultiHostConfig
from multiserve.fleet.config_loader import fleet_config_from_dict
from multiserve.fleet.slice_start import agreed_fields, devices_per_host
from multiserve.fleet.startup import fleet_config_from_args
from multiserve.multihost.fingerprint import differences

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_one_host_is_the_default_and_starts_nothing() -> None:
    cfg = MultiHostConfig()
    assert not cfg.enabled and cfg.is_leader


@pytest.mark.parametrize("fields, field", [
    (dict(nnodes=2, node_rank=2, dist_init_addr="h:1"), "node_rank"),
    (dict(nnodes=0), "nnodes"),
    (dict(nnodes=2, node_rank=1), "dist_init_addr"),
    (dict(nnodes=2, dist_init_addr="nohost"), "dist_init_addr"),
    (dict(nnodes=2, dist_init_addr="h:65535"), "dist_init_addr"),
    (dict(nnodes=2, dist_init_addr="h:x"), "dist_init_addr"),
])
def test_invalid_slices_are_refused_naming_the_field(fields: dict, field: str) -> None:
    with pytest.raises(ConfigError) as e:
        MultiHostConfig(**fields)
    assert e.value.field == field


def test_ports_of_a_slice() -> None:
    cfg = MultiHostConfig(nnodes=4, node_rank=3, dist_init_addr="10.0.0.1:8476")
    assert (cfg.host, cfg.coordinator_port, cfg.stream_port) == ("10.0.0.1", 8476, 8477)
    assert not cfg.is_leader


def test_sglang_flags_set_the_fleet_keys() -> None:
    args = build_parser().parse_args([
        "serve", "--config", str(CONFIGS / "cpu-slice-2x2.toml"), "--nnodes", "2",
        "--node-rank", "1", "--dist-init-addr", "127.0.0.1:29500"])
    cfg = fleet_config_from_args(args)
    assert cfg.multihost == MultiHostConfig(nnodes=2, node_rank=1,
                                            dist_init_addr="127.0.0.1:29500")
    assert cfg.engines[0].device_indexes == (0, 1, 2, 3)
    assert devices_per_host(cfg) == 2


def test_fleet_keys_are_validated_with_their_fleet_name() -> None:
    data = {"fleet": {"nnodes": 2, "node_rank": 5, "dist_init_addr": "h:9"},
            "engines": [{"device_indexes": [0, 1]}]}
    with pytest.raises(ConfigError) as e:
        fleet_config_from_dict(data)
    assert e.value.field == "fleet.node_rank"


def test_hosts_agree_on_everything_but_their_rank_and_a_difference_is_named() -> None:
    base = {"fleet": {"nnodes": 2, "dist_init_addr": "h:9"},
            "engines": [{"device_indexes": [0, 1, 2, 3]}]}
    leader = fleet_config_from_dict(base)
    follower = fleet_config_from_dict({**base, "fleet": {**base["fleet"], "node_rank": 1}})
    assert agreed_fields(leader) == agreed_fields(follower)
    other = fleet_config_from_dict({**base, "engine": {"page_size": 32}})
    diff = differences(agreed_fields(leader), {**agreed_fields(other), "rank": "1"})
    assert diff == ["engines[0].page_size: node 0 has 16, node 1 has 32"]
