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

import pytest  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_programs_between_modules():
    """After each test module, drop JAX's in-memory compiled programs (later modules get
    them back from the persistent cache above). Without it the suite's process kept every
    engine's programs alive and grew past 16 GB (an OOM kill on a 24 GB machine)."""
    yield
    if "jax" in sys.modules:
        gc.collect()
        sys.modules["jax"].clear_caches()
        gc.collect()
