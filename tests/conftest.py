"""Suite-wide setup: 4 virtual host devices (set before anything imports jax) and a
persistent compilation cache, so engines with the same shapes compile once per run."""

import os
import tempfile

# excess precision off: the engine compiles its step programs so (bf16 rows stay invariant,
# engine/device/program_share.py); the model-level tests' own jits must match them
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4 "
                      "--xla_allow_excess_precision=false")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      os.path.join(tempfile.gettempdir(), "multiserve-test-jax-cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# The weights' huge-page collapse (engine/device/huge_pages.py) is placement only (no value
# changes) and costs ~2 s of kernel time per default-model engine, of which the suite
# builds dozens: off here; tests/engine/test_huge_pages.py turns it on and checks it,
# engine included.
os.environ.setdefault("MULTISERVE_HUGE_PAGES", "0")



import gc  # noqa: E402
import inspect  # noqa: E402
import sys  # noqa: E402
import warnings  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402

_TESTS = Path(__file__).resolve().parent


def _top_dir(item: pytest.Item) -> str:
    return Path(item.path).resolve().relative_to(_TESTS).parts[0]


_SESSION_FIXTURES: list[tuple[str, Any]] = []  # (top-level test dir, FixtureDef) set up


class _SessionFixtureNotes:
    """A global plugin (a conftest's own hooks do not see session-scoped fixtures: those
    run with the session's hooks): notes each session-scoped fixture defined in a
    conftest under tests/<dir>/ when it is set up."""

    @staticmethod
    def pytest_fixture_setup(fixturedef: Any, request: pytest.FixtureRequest) -> None:
        if fixturedef.scope != "session":
            return
        try:
            where = Path(fixturedef.func.__code__.co_filename).resolve().relative_to(_TESTS)
        except (AttributeError, ValueError):
            return  # a plugin's fixture
        if len(where.parts) > 1:
            _SESSION_FIXTURES.append((where.parts[0], fixturedef))


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(_SessionFixtureNotes(), "multiserve-session-fixture-notes")


# Python's cyclic collector: each full collection scans every tracked object not frozen, and
# the suite's processes hold millions (jax, torch, transformers, the engines' programs). Off
# while the test modules are imported (collection: 10 full collections of the growing heap,
# 2.0 of a worker's 6.1 CPU-s), then everything imported is frozen and the thresholds are
# the command line's (multiserve/host/collector.py), so the full collections that follow each
# module's freeze (`pytest_runtest_teardown`) come ~14x less often. No test depends on when
# garbage is collected: memory is returned at the module and directory boundaries, which
# collect explicitly.
@pytest.hookimpl(hookwrapper=True)
def pytest_collection(session: pytest.Session):  # type: ignore[no-untyped-def]
    """Collection with the cyclic collector off; then one collection, what survived (every
    module imported) frozen, and the collector on at the command line's thresholds."""
    gc.disable()
    try:
        yield
    finally:
        gc.collect()
        gc.freeze()
        from multiserve.host.collector import tune_collector

        tune_collector()
        gc.enable()


# Under `-n 3 --dist loadfile --no-loadscope-reorder` (scripts/test.sh) each test file runs
# whole in one process, in this order: the longest files start first (measured with
# --durations=0 on 2 cores), so that no long file starting last leaves a core idle at the
# end (the test files from about 10 s up are named, longest first, by the measured time of
# a fresh run); tests/engine/ and tests/server/ each run as one block, so their shared
# session fixtures (engines, servers) are built once in each process that runs them (the
# second build loads its programs and plans from the caches). The order is also the order
# of a plain one-process run.
_LONG_FIRST = ("chaos/test_chaos.py", "fleet/test_fleet_four.py", "engine",
               "fleet/test_fleet_validate.py", "multihost/test_multihost_engine.py",
               "model/test_batch_invariance.py", "reliability/test_schema_fuzz.py",
               "model/test_families.py", "model/test_moe.py",
               "model/test_pallas_attention.py", "model/test_native_kernels.py",
               "model/test_default_model.py", "bench/test_bench_smoke.py",
               "test_doctor_compile.py", "model/test_sharding.py",
               "fleet/test_fleet_tp.py", "multihost/test_multihost_faults.py",
               "model/test_calibration.py", "server",
               "plugins/test_tunix_venv.py", "model/test_kernel_arithmetic.py",
               "test_doctor_target.py", "model/test_tpu_attention.py", "test_type_check.py",
               "model/test_hf_parity.py", "model/test_native_kernels_bf16.py",
               "model/test_attention_terms.py",
               "model/test_row_invariance.py", "bench/test_bench_peers.py",
               "bench/test_bench_fleet.py", "plugins/test_rollout.py",
               "fleet/test_supervisor.py")


def _rank_key(item: pytest.Item) -> str:
    rel = Path(item.path).resolve().relative_to(_TESTS)
    return rel.parts[0] if rel.parts[0] in ("engine", "server") else rel.as_posix()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest files first (see _LONG_FIRST); a file's tests keep their order. Marks
    the tests that run on any accelerator `device_generic` (tests/device_generic.py)."""
    from device_generic import is_device_generic

    for item in items:
        if is_device_generic(Path(item.path).resolve().relative_to(_TESTS).as_posix(), item):
            item.add_marker(pytest.mark.device_generic)
    rank = {name: i for i, name in enumerate(_LONG_FIRST)}
    items.sort(key=lambda it: rank.get(_rank_key(it), len(rank)))


def fixture_finisher(fixturedef: Any, item: Any) -> Callable[[], None] | None:
    """A call that tears down `fixturedef` now, or None where this pytest lacks what it
    uses: `FixtureDef.finish(request)` and `Item._request` are pytest internals (no public
    API tears down one session fixture early). Without them the fixtures simply live to
    the end of the session (more memory, same results)."""
    finish = getattr(fixturedef, "finish", None)
    request = getattr(item, "_request", None)
    if not callable(finish) or request is None:
        return None
    try:
        if "request" not in inspect.signature(finish).parameters:
            return None
    except (TypeError, ValueError):
        return None
    return lambda: finish(request)


_EARLY_TEARDOWN_WARNED: list[bool] = []


def _finish_session_fixtures_of(item: pytest.Item, top: str) -> None:
    """Tear down the session-scoped fixtures defined under tests/<top>/ (their engines,
    fleets, servers) now that no test of that directory is left, instead of at the end of
    the session (pytest's "package" scope would need __init__.py files, which would break
    these tests' imports). A later request for one would simply build it again."""
    for i in reversed(range(len(_SESSION_FIXTURES))):
        where, fixturedef = _SESSION_FIXTURES[i]
        if where == top:
            del _SESSION_FIXTURES[i]
            if fixturedef.cached_result is None:
                continue
            finish = fixture_finisher(fixturedef, item)
            if finish is not None:
                finish()
            elif not _EARLY_TEARDOWN_WARNED:
                _EARLY_TEARDOWN_WARNED.append(True)
                warnings.warn(f"pytest {pytest.__version__}: no FixtureDef.finish(request); "
                              "session fixtures live to the end of the session", stacklevel=1)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):  # type: ignore[no-untyped-def]
    """When the run leaves a top-level test directory (tests/engine -> tests/fleet ...),
    finish that directory's session-scoped fixtures (the engines it shares) and drop JAX's
    in-memory compiled programs. Without it the suite's process kept every directory's
    engines and programs to the end, more than a small machine's memory (docs/performance.md
    §10).
    Only at directory boundaries: engines shared inside a directory assert zero
    recompiles after warm-up."""
    yield
    if nextitem is not None and _top_dir(nextitem) != _top_dir(item):
        _finish_session_fixtures_of(item, _top_dir(item))
        gc.unfreeze()  # the session fixtures just finished may sit in the frozen objects
        if "jax" in sys.modules:  # its traces and programs go; the collection below frees
            sys.modules["jax"].clear_caches()  # what refcounts alone do not (one full scan)
    if nextitem is None or nextitem.path != item.path:  # a module's fixtures are gone
        # glibc keeps freed heap pages (a torn-down fleet's GBs) unless asked; without
        # this the suite's RSS only ever grew (docs/performance.md §10)
        gc.collect()
        # what survived this collection (imported modules, the directory's session
        # fixtures) is frozen: the next module's collection scans only what is newer
        # (a full collection of torch + transformers + jax objects cost ~0.2 s a module);
        # a directory boundary unfreezes and collects everything (above)
        gc.freeze()
        from multiserve.host.heap import release_free_heap

        release_free_heap()

