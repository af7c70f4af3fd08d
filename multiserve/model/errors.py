"""Errors raised at the model package's edge (loading files). Imports nothing heavy."""

from __future__ import annotations


class ModelLoadError(ValueError):
    """A model file or directory cannot be loaded; the message names the file and, where one
    is at fault, the tensor."""
