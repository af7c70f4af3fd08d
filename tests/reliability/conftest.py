"""Fixtures of the reliability tests: the tiny random model (full tokenizer vocabulary,
so chat and text prompts work) written once per session, and a perturbed twin of it."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from multiserve.reliability.tiny_model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny-reliability"), seed=0)
