"""What every host of a slice must agree on before it starts: its own view of the
configuration and the software, as named strings, and the differences between two views."""

from __future__ import annotations

import platform
import sys
from typing import Any


def fingerprint(fleet_repr: str, nnodes: int) -> dict[str, str]:
    """This host's view: the fleet config (its repr: every field that shapes the engines),
    the slice size, and the versions of what computes (Python, jax, jaxlib, multiserve)."""
    import jax
    import jaxlib

    from multiserve import __version__

    return {"fleet config": fleet_repr, "nnodes": str(nnodes),
            "python": platform.python_version(), "jax": jax.__version__,
            "jaxlib": jaxlib.__version__, "multiserve": __version__,
            "byteorder": sys.byteorder}


def differences(leader: dict[str, Any], follower: dict[str, Any]) -> list[str]:
    """Each key whose values differ, as "key: leader X, this host Y" (long values are cut
    to their first differing stretch)."""
    out = []
    for key in sorted({*leader, *follower}):
        a, b = str(leader.get(key)), str(follower.get(key))
        if a != b:
            at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            lo = max(0, at - 40)
            out.append(f"{key}: leader ...{a[lo:at + 60]!r}..., this host "
                       f"...{b[lo:at + 60]!r}...")
    return out
