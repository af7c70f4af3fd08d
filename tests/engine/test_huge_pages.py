"""The weights' host buffers on 2 MiB pages (engine/device/huge_pages.py): placement that
changes no value, asked for off the engine's path, and off when told."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from multiserve.engine.device import huge_pages
from multiserve.engine.device.huge_pages import HUGE_PAGE, back_with_huge_pages



def _reason_when_asked() -> str | None:
    """Why huge pages are unavailable on this machine even when asked for (tests/conftest.py
    turns them off for the rest of the suite)."""
    saved = os.environ.get(huge_pages.ENV)
    os.environ[huge_pages.ENV] = "1"
    try:
        return huge_pages.unavailable_reason()
    finally:
        if saved is None:
            del os.environ[huge_pages.ENV]
        else:
            os.environ[huge_pages.ENV] = saved


pytestmark = pytest.mark.skipif(_reason_when_asked() is not None,
                                reason=f"no huge pages here: {_reason_when_asked()}")


@pytest.fixture(autouse=True)
def _asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(huge_pages.ENV, "1")


def _huge_bytes_under(pointer: int) -> int:
    """AnonHugePages of the mapping that holds `pointer` (/proc/self/smaps), in bytes."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(v, 16) for v in head.split("-"))
                inside = lo <= pointer < hi
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1]) * 1024
    return 0


def test_collapsed_buffers_keep_every_bit_and_sit_on_huge_pages() -> None:
    rng = np.random.default_rng(0)
    host = rng.standard_normal((3, 1536, 1536)).astype(np.float32)  # 27 MB
    small = jnp.asarray(rng.standard_normal(100).astype(np.float32))
    tree = {"w": jnp.asarray(host).astype(jnp.bfloat16), "small": small}
    expected = np.asarray(tree["w"]).copy()
    advice = back_with_huge_pages(tree)
    nbytes = tree["w"].nbytes
    # the 2 MiB-aligned interior of the one buffer that is large enough
    assert nbytes - 2 * HUGE_PAGE <= advice.advised_bytes <= nbytes
    assert advice.skipped is None and advice.advised_bytes % HUGE_PAGE == 0
    np.testing.assert_array_equal(np.asarray(tree["w"]), expected)
    if advice.collapsed_bytes == 0:  # the kernel found no free 2 MiB pages: advice only
        pytest.skip("MADV_COLLAPSE collapsed nothing (memory too fragmented or an old kernel)")
    # MADV_HUGEPAGE splits the mapping at the interior's bounds: look where it starts
    interior = -(-tree["w"].unsafe_buffer_pointer() // HUGE_PAGE) * HUGE_PAGE
    assert _huge_bytes_under(interior) >= HUGE_PAGE
    # programs read it as before: the same result as from a copy on ordinary pages
    total = jax.jit(lambda w: jnp.sum(w.astype(jnp.float32)))
    assert float(total(tree["w"])) == float(total(jnp.asarray(expected)))


def test_turned_off_by_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(huge_pages.ENV, "0")
    advice = back_with_huge_pages({"w": jnp.zeros((4 * HUGE_PAGE,), jnp.uint8)})
    assert (advice.advised_bytes, advice.collapsed_bytes) == (0, 0)
    assert advice.skipped == f"{huge_pages.ENV}=0"


@pytest.fixture
def engine_asking(tiny_model_dir: Path) -> Iterator[Any]:
    """The tiny engine's settings, built while huge pages are asked for (the suite's shared
    engines are built with them off)."""
    from engine_helpers import TINY_ENGINE

    from multiserve.config import EngineConfig
    from multiserve.engine.engine import Engine

    eng = Engine(EngineConfig(model_path=str(tiny_model_dir), **TINY_ENGINE))
    try:
        yield eng
    finally:
        eng.shutdown()


def test_the_engine_reports_its_weights_advice(engine_asking: Any) -> None:
    tiny_engine = engine_asking
    runner = tiny_engine._core.runner
    thread = runner.huge_pages_thread
    assert thread is not None and thread.name == "huge-pages"
    thread.join(timeout=60)
    assert not thread.is_alive()
    state = tiny_engine.get_internal_state()["huge_pages"]
    assert set(state) == {"weights"}
    weights = state["weights"]
    assert weights["skipped"] is None and weights["advised_bytes"] % HUGE_PAGE == 0
    assert weights["collapsed_bytes"] <= weights["advised_bytes"]
