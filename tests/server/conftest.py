"""Shared fixtures for the server tests: the default model's tokenizer directory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def _tokenizer_dir() -> Path:
    override = os.environ.get("MULTISERVE_TEST_TOKENIZER_DIR")
    if override:
        return Path(override)
    from multiserve.model.default_model import default_model_path

    return Path(default_model_path())


@pytest.fixture(scope="session")
def tokenizer_dir() -> Path:
    return _tokenizer_dir()


@pytest.fixture(scope="session")
def tm(tokenizer_dir: Path):
    from multiserve.server.tokenizer import TokenizerManager

    return TokenizerManager(tokenizer_dir, context_len=512, model_name="test-model")
