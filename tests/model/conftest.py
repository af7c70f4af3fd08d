"""tests/model fixtures: the default model (SmolLM2-135M-Instruct) loaded once per session.

The virtual device count (4 CPU devices) comes from the root tests/conftest.py."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def default_model():
    from multiserve.model.loading.loader import load_model

    return load_model(None, "float32")
