"""Server options of a fleet (issue 21): `[fleet] max_request_bytes` and
`enable_memory_saver` (also `--max-request-bytes`, `--enable-memory-saver`) reach every
engine server and the supervisor, live. Each /get_server_info reports
enable_memory_saver as set; a body over the bound is a 413 stating it on every server;
memory release and resume work with the option set (with it unset, as the slime test's
fleet runs: tests/server/clients/test_slime.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.slow

LIMIT = 65536


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from multiserve.fleet.config_loader import fleet_config_from_dict
    from multiserve.fleet.launch import launch_fleet
    from multiserve.reliability.tiny_model import tiny_engine_fields, write_tiny_model

    model = write_tiny_model(tmp_path_factory.mktemp("tiny-options"))
    cfg = fleet_config_from_dict({  # what configs/*.toml parse to
        "model": {"path": str(model)},
        "fleet": {"platform": "cpu", "host": "127.0.0.1", "base_port": 0,
                  "supervisor_port": 0, "max_request_bytes": LIMIT,
                  "enable_memory_saver": True},
        "engine": {k: list(v) if isinstance(v, tuple) else v
                   for k, v in tiny_engine_fields().items()},
        "engines": [{"device_indexes": [0]}, {"device_indexes": [1]}]})
    f = launch_fleet(cfg, announce=False)
    yield f
    f.stop("abort")


def test_every_server_reports_enable_memory_saver_as_set(fleet: Any) -> None:
    with httpx.Client(timeout=60) as h:
        for url in fleet.urls:
            for path in ("/get_server_info", "/server_info"):
                info = h.get(f"{url}{path}").json()
                assert info["enable_memory_saver"] is True, info
                assert info["max_request_bytes"] == LIMIT
        sup = h.get(f"{fleet.supervisor_url}/get_server_info").json()
        assert sup["enable_memory_saver"] is True and sup["max_request_bytes"] == LIMIT


def test_every_server_refuses_a_body_over_the_bound(fleet: Any) -> None:
    big = "x" * (LIMIT + 1)
    with httpx.Client(timeout=60) as h:
        for url, path, body in [
                *((u, "/v1/chat/completions", {"messages": [{"role": "user", "content": big}]})
                  for u in fleet.urls),
                (fleet.urls[0], "/v1/completions", {"prompt": big}),
                (fleet.urls[1], "/generate", {"text": big}),
                (fleet.supervisor_url, "/pause_generation", {"mode": "abort", "x": big})]:
            r = h.post(f"{url}{path}", json=body)
            assert r.status_code == 413, (url, path, r.text[:200])
            assert str(LIMIT) in r.json()["error"]["message"]
        assert not h.get(f"{fleet.urls[0]}/get_server_info").json()["engine_paused"]
        r = h.post(f"{fleet.urls[0]}/generate",
                   json={"text": "Hello", "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code == 200 and len(r.json()["output_ids"]) == 2


def test_memory_release_and_resume_work_with_the_option_set(fleet: Any) -> None:
    with httpx.Client(timeout=120) as h:
        url = fleet.urls[0]
        r = h.post(f"{url}/release_memory_occupation", json={})
        assert r.status_code == 200 and r.json()["success"], r.text
        assert set(h.get(f"{url}/get_server_info").json()["memory_released"]) == {
            "weights", "kv_cache"}
        r = h.post(f"{url}/resume_memory_occupation", json={})
        assert r.status_code == 200 and r.json()["success"], r.text
        for path in ("/release_memory_occupation", "/resume_memory_occupation"):  # fleet-wide
            r = h.post(f"{fleet.supervisor_url}{path}", json={})
            assert r.status_code == 200 and r.json()["success"], r.text
        for u in fleet.urls:
            assert h.get(f"{u}/get_server_info").json()["memory_released"] == []
            r = h.post(f"{u}/generate",
                       json={"text": "Hello", "sampling_params": {"max_new_tokens": 2}})
            assert r.status_code == 200 and len(r.json()["output_ids"]) == 2
