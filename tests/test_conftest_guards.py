"""tests/conftest.py's use of pytest internals degrades, never breaks: `fixture_finisher`
gives a teardown call only where this pytest has `FixtureDef.finish(request)` and
`Item._request`, and None otherwise (the fixtures then live to the end of the session)."""

from __future__ import annotations

import importlib.util
import types
from pathlib import Path
from typing import Any

import pytest


def _suite_conftest() -> Any:
    path = Path(__file__).resolve().parent / "conftest.py"
    spec = importlib.util.spec_from_file_location("suite_conftest_under_test", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _FixtureDefWithFinish:
    def __init__(self) -> None:
        self.finished_with: list[Any] = []

    def finish(self, request: Any) -> None:
        self.finished_with.append(request)


def test_finisher_calls_finish_with_the_items_request() -> None:
    finisher = _suite_conftest().fixture_finisher
    fixturedef, request = _FixtureDefWithFinish(), object()
    finish = finisher(fixturedef, types.SimpleNamespace(_request=request))
    assert finish is not None
    finish()
    assert fixturedef.finished_with == [request]


@pytest.mark.parametrize("fixturedef, item", [
    (types.SimpleNamespace(), types.SimpleNamespace(_request=object())),  # no finish
    (_FixtureDefWithFinish(), types.SimpleNamespace()),  # no _request
    (types.SimpleNamespace(finish=lambda: None), types.SimpleNamespace(_request=object())),
], ids=["no-finish", "no-request", "finish-without-request"])
def test_finisher_is_none_where_pytest_lacks_the_internals(fixturedef: Any, item: Any) -> None:
    assert _suite_conftest().fixture_finisher(fixturedef, item) is None
