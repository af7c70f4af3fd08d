"""Helpers for tests and benchmarks: random params and writing an HF-format model dir.
Numpy only (no jax, no torch)."""

from __future__ import annotations

from multiserve.model.loading.hf import config_to_hf, save_hf_dir
from multiserve.model.loading.param_layout import init_random_params, param_shapes

__all__ = ["config_to_hf", "init_random_params", "param_shapes", "save_hf_dir"]
