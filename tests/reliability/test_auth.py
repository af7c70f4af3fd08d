"""API key and exposed binds.

With `api_key` set, every route of every engine app and of the supervisor (control and
weight endpoints above all) answers 401 with an OpenAI error body unless the request
carries `Authorization: Bearer <key>`; with it, they work (the `openai` client included).
A non-loopback host without a key logs a clear WARNING at start-up.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

KEY = "sk-test-4f1d2c"


@pytest.fixture(scope="module")
def fleet(tiny_model: Path) -> Iterator[Any]:
    from multiserve.fleet.launch import launch_fleet
    from multiserve.reliability.tiny_model import tiny_fleet_config

    f = launch_fleet(tiny_fleet_config(tiny_model, engines=1, api_key=KEY), announce=False)
    yield f
    f.stop("abort")


def routes(app: Any) -> list[tuple[str, str]]:
    out = []
    for r in app.routes:
        for m in sorted(getattr(r, "methods", None) or ()):
            if m not in ("HEAD", "OPTIONS"):
                out.append((m, r.path))
    return out


def test_every_route_needs_the_key(fleet: Any) -> None:
    apps = [(fleet.urls[0], fleet.servers[0]._server.config.app),
            (fleet.supervisor_url, fleet.supervisor._server.config.app)]
    checked = 0
    http = httpx.Client(timeout=30)
    for url, app in apps:
        table = routes(app)
        assert ("POST", "/update_weights_from_disk") in table
        assert ("POST", "/pause_generation") in table
        for method, path in [*table, ("GET", "/no/such/route")]:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                            {"Authorization": f"Basic {KEY}"}):
                r = http.request(method, url + path, headers=headers, json={})
                assert r.status_code == 401, (method, path, headers, r.text)
                err = r.json()["error"]
                assert err["code"] == "invalid_api_key" and err["message"], err
                assert KEY not in r.text
                assert r.headers["www-authenticate"].startswith("Bearer")
                checked += 1
    http.close()
    assert checked > 40


def test_the_key_opens_every_server(fleet: Any) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    for url in (*fleet.urls, fleet.supervisor_url):
        assert httpx.get(f"{url}/health", headers=auth, timeout=30).status_code == 200
    r = httpx.post(f"{fleet.supervisor_url}/flush_cache", headers=auth, timeout=60)
    assert r.status_code == 200, r.text
    with openai.OpenAI(base_url=f"{fleet.urls[0]}/v1", api_key=KEY, max_retries=0) as c:
        out = c.completions.create(model=fleet.workers[0].model_name, prompt="Hello",
                                   max_tokens=3, temperature=0)
    assert out.choices[0].finish_reason in ("length", "stop")
    with openai.OpenAI(base_url=f"{fleet.urls[0]}/v1", api_key="wrong", max_retries=0) as c:
        with pytest.raises(openai.AuthenticationError):
            c.models.list()


def test_exposed_bind_without_key_warns(caplog: pytest.LogCaptureFixture) -> None:
    from multiserve.server.auth import exposure_warning, is_loopback, warn_if_exposed

    for host in ("127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"):
        assert is_loopback(host) and exposure_warning(host, None) is None
    for host in ("0.0.0.0", "::", "10.1.2.3", "example.internal"):
        assert not is_loopback(host)
        assert exposure_warning(host, "k") is None  # a key: no warning
    with caplog.at_level(logging.WARNING, logger="multiserve.server"):
        text = warn_if_exposed("0.0.0.0", None)
    assert text and "not a loopback address" in text and "--api-key" in text
    assert any(r.levelno == logging.WARNING and "WITHOUT an API key" in r.getMessage()
               for r in caplog.records)


def test_launch_warns_before_binding(caplog: pytest.LogCaptureFixture, tiny_model: Path
                                     ) -> None:
    """The launcher warns about a non-loopback host before it builds anything. The host
    here is a documentation address (TEST-NET-3) that is on no interface of this machine:
    the port check then fails to bind, so no socket ever listens beyond loopback."""
    from dataclasses import replace

    from multiserve.config import ConfigError, ServerConfig
    from multiserve.fleet.launch import launch_fleet
    from multiserve.reliability.tiny_model import tiny_fleet_config

    base = tiny_fleet_config(tiny_model, engines=1)
    cfg = replace(base, servers=(ServerConfig(host="203.0.113.7", port=31999),))
    with caplog.at_level(logging.WARNING, logger="multiserve.server"):
        with pytest.raises(ConfigError, match="not free"):
            launch_fleet(cfg, announce=False)
    assert any("203.0.113.7" in r.getMessage() and "WITHOUT an API key" in r.getMessage()
               for r in caplog.records)
