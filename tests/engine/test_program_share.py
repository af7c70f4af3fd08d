"""One compile per step program per process (engine/device/program_share.py).

What is checked: an engine on another device, with the same model and buckets as an
engine that already compiled its programs, warms up without one persistent-cache miss
(every program is loaded, none compiled), and its outputs (ids and logprobs, greedy and
seeded, alone and batched) are bitwise the first engine's; the loaded programs run on its
own device."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import jax
import pytest

from multiserve.engine.commands import Call
from multiserve.engine.device.programs import background_compiles_running
from multiserve.types import SamplingParams

DEVICE = 3  # not the shared tiny engine's device


def _outputs(engine: Any) -> list[tuple[Any, Any]]:
    greedy = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True,
                            return_logprob=True)
    seeded = SamplingParams(temperature=0.9, top_p=0.9, max_new_tokens=10, ignore_eos=True,
                            return_logprob=True, seed=11)
    prompts = [[5, 17, 42, 99, 7], [3, 3, 8] * 7]
    alone = [engine.generate(input_ids=p, sampling_params=greedy) for p in prompts]
    together = engine.generate(input_ids=prompts, sampling_params=[greedy, seeded])
    return [(o.output_ids, o.logprobs) for o in (*alone, *together)]


def test_a_second_device_loads_every_program_and_matches_bitwise(tiny_engine: Any) -> None:
    from jax import monitoring

    from multiserve.engine.engine import Engine

    if not jax.config.jax_compilation_cache_dir:
        pytest.skip("the persistent compilation cache is off")
    assert tiny_engine.wait_compiled(600)
    # the events below are the process's: no other engine (an earlier test's, still
    # compiling its small buckets in the background) may compile meanwhile
    deadline = time.monotonic() + 600
    while background_compiles_running() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert background_compiles_running() == 0
    events: Counter[str] = Counter()

    def count(name: str, **_: Any) -> None:
        events.update([name])

    monitoring.register_event_listener(count)
    other = Engine(tiny_engine.config.with_updates(device_indexes=(DEVICE,)))
    try:
        assert other.wait_compiled(600)
        warm = dict(events)
        assert warm.get("/jax/compilation_cache/cache_misses", 0) == 0, warm
        assert warm.get("/jax/compilation_cache/cache_hits", 0) >= 2, warm
        assert other.get_internal_state()["program_sharing"]["active"] is True
        params, kv = other.call(Call(lambda c: (c.runner.params, c.runner.kv))).result()
        assert all(x.devices() == {jax.devices()[DEVICE]}
                   for x in jax.tree.leaves((params, kv)))
        assert _outputs(other) == _outputs(tiny_engine)
    finally:
        other.shutdown()
        monitoring.unregister_event_listener(count)


# ---- the fallback: a JAX whose cache-key hook is not the verified one -------------------

@pytest.fixture
def unhooked_jax(monkeypatch: pytest.MonkeyPatch) -> Any:
    """This process as it would be on a JAX without the patched hook: the program-share
    module sees a cache-key module lacking it (a stand-in: jax's own must keep working),
    JAX's keys are its own again (device assignment included), and nothing is installed
    yet. monkeypatch puts back the hook and the module state afterwards."""
    import types

    from jax._src import cache_key

    from multiserve.engine.device import program_share as ps

    hookless = types.ModuleType("cache_key_without_hook")
    hookless.get = cache_key.get  # type: ignore[attr-defined]
    monkeypatch.setattr(ps, "_jax_cache_key", lambda: hookless)
    if ps.unpatched_hook is not None:
        monkeypatch.setattr(cache_key, ps._HOOK, ps.unpatched_hook)  # noqa: SLF001
    monkeypatch.setattr(ps, "_install_problem", None)
    monkeypatch.setattr(ps, "_installed", False)
    return ps


def test_missing_hook_turns_sharing_off_with_one_warning(
        unhooked_jax: Any, caplog: pytest.LogCaptureFixture) -> None:
    ps = unhooked_jax
    assert "has no _hash_serialized_compile_options" in (ps.hook_problem() or "")
    with caplog.at_level("WARNING", logger=ps.__name__):
        assert not ps._install_device_free_key()  # noqa: SLF001
        assert not ps._install_device_free_key()  # noqa: SLF001
    assert sum("program sharing off" in r.getMessage() for r in caplog.records) == 1


def test_unverified_jax_release_turns_sharing_off(monkeypatch: pytest.MonkeyPatch) -> None:
    from multiserve.engine.device import program_share as ps

    monkeypatch.setattr(jax, "__version__", "0.99.0")
    monkeypatch.delenv("MULTISERVE_SHARE_PROGRAMS", raising=False)
    assert "outside the releases" in (ps.hook_problem() or "")
    monkeypatch.setenv("MULTISERVE_SHARE_PROGRAMS", "force")
    assert ps.hook_problem() is None  # the hook itself is there, so force installs it


def test_without_the_hook_an_engine_compiles_its_own_programs_and_generates(
        tiny_engine: Any, unhooked_jax: Any) -> None:
    from multiserve.engine.engine import Engine

    assert tiny_engine.wait_compiled(600)
    other = Engine(tiny_engine.config.with_updates(device_indexes=(DEVICE,)))
    try:
        assert other.wait_compiled(600)
        sharing = other.get_internal_state()["program_sharing"]
        if jax.config.jax_compilation_cache_dir:
            assert sharing["active"] is False
            assert "has no _hash_serialized_compile_options" in sharing["reason"]
        assert _outputs(other) == _outputs(tiny_engine)
    finally:
        other.shutdown()


def test_first_alone_runs_an_equal_key_after_the_one_inside() -> None:
    """`first_alone`: a thread whose key is inside another thread's body waits until that
    body ends, then runs its own; an unequal key never waits."""
    import threading

    from multiserve.engine.device.program_share import SHARE

    if not SHARE._active("cpu"):  # noqa: SLF001
        pytest.skip("program sharing is off here")
    key = ("test_first_alone", object())
    inside, release, log = threading.Event(), threading.Event(), []

    def first() -> None:
        with SHARE.first_alone(key, "cpu"):
            inside.set()
            release.wait(60)
            log.append("first done")

    def second(k: Any) -> None:
        with SHARE.first_alone(k, "cpu"):
            log.append(f"body of {k[0]}")

    a = threading.Thread(target=first)
    a.start()
    assert inside.wait(60)
    other = threading.Thread(target=second, args=(("unequal",),))
    other.start()
    other.join(60)
    assert log == ["body of unequal"]  # ran while the first body is still inside
    b = threading.Thread(target=second, args=(key,))
    b.start()
    running = SHARE._in_flight[key]  # noqa: SLF001
    deadline = time.monotonic() + 60
    while not running._cond._waiters and time.monotonic() < deadline:  # noqa: SLF001
        time.sleep(0.01)  # until b waits on the first body
    assert running._cond._waiters and log == ["body of unequal"]  # noqa: SLF001
    release.set()
    a.join(60)
    b.join(60)
    assert log == ["body of unequal", "first done", "body of test_first_alone"]
    assert key not in SHARE._in_flight  # noqa: SLF001
