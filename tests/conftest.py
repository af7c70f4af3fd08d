"""Suite-wide setup: 4 virtual host devices (set before anything imports jax) and a
persistent compilation cache, so engines with the same shapes compile once per run."""

import os
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      os.path.join(tempfile.gettempdir(), "multiserve-test-jax-cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")



import gc  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

_TESTS = Path(__file__).resolve().parent


def _top_dir(item: pytest.Item) -> str:
    return Path(item.path).resolve().relative_to(_TESTS).parts[0]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):  # type: ignore[no-untyped-def]
    """When the run leaves a top-level test directory (tests/engine -> tests/fleet ...),
    drop JAX's in-memory compiled programs once that directory's fixtures are torn down.
    Without it the suite's process kept every engine's programs and grew past 16 GB (an
    OOM kill on a 24 GB machine). Only at directory boundaries: engines shared inside a
    directory assert zero recompiles after warm-up."""
    yield
    if nextitem is not None and _top_dir(nextitem) != _top_dir(item) and "jax" in sys.modules:
        gc.collect()
        sys.modules["jax"].clear_caches()
        gc.collect()
