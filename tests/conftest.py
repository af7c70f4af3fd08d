"""Suite-wide setup: 4 virtual host devices (before anything imports jax) and a
persistent compilation cache so repeated engine warm-ups are cheap."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
