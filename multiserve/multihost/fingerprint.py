"""What every host of a slice must agree on before it starts: its own view of the
configuration and the software, as named strings, and the differences between two views."""

from __future__ import annotations

import dataclasses
import platform
import sys
from typing import Any


def flat_fields(record: Any, prefix: str = "") -> dict[str, str]:
    """A (frozen) dataclass as {dotted field name: repr}, nested records and tuples of
    them expanded ("engines[0].max_running_requests"), so a difference names its field."""
    if dataclasses.is_dataclass(record) and not isinstance(record, type):
        out: dict[str, str] = {}
        for f in dataclasses.fields(record):
            if f.repr:
                out.update(flat_fields(getattr(record, f.name), f"{prefix}{f.name}."))
        return out
    if isinstance(record, tuple) and record and all(
            dataclasses.is_dataclass(x) for x in record):
        out = {}
        for i, x in enumerate(record):
            out.update(flat_fields(x, f"{prefix[:-1]}[{i}]."))
        return out
    return {prefix[:-1]: repr(record)}


def fingerprint(agreed: dict[str, str], nnodes: int) -> dict[str, str]:
    """This host's view: `agreed` (e.g. the fleet config's `flat_fields`), the slice size,
    and the versions of what computes (Python, jax, jaxlib, multiserve)."""
    from importlib.metadata import PackageNotFoundError, version

    import jax
    import jaxlib

    try:
        ours = version("multiserve")
    except PackageNotFoundError:
        ours = "not installed"
    return {**agreed, "nnodes": str(nnodes),
            "python": platform.python_version(), "jax": jax.__version__,
            "jaxlib": jaxlib.__version__, "multiserve": ours,
            "byteorder": sys.byteorder}


def differences(leader: dict[str, Any], follower: dict[str, Any]) -> list[str]:
    """Each key whose values differ, as "key: node 0 has X, this host Y" (values over 200
    characters cut)."""
    return [f"{key}: node 0 has {str(leader.get(key))[:200]}, node {follower.get('rank')} has "
            f"{str(follower.get(key))[:200]}"
            for key in sorted({*leader, *follower} - {"rank"})
            if str(leader.get(key)) != str(follower.get(key))]
