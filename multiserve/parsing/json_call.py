"""Turning decoded JSON into calls: the {"name", "arguments" | "parameters"} objects that
hermes, llama3 and mistral outputs hold."""

from __future__ import annotations

import json
from typing import Any

from multiserve.parsing.base import RawCall


def calls_from_json(value: Any) -> list[RawCall] | None:
    """One object or a list of them -> calls (an empty list: no calls); None if any is
    not a call object."""
    items = value if isinstance(value, list) else [value]
    out: list[RawCall] = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        args = item.get("arguments", item.get("parameters", {}))
        out.append((item["name"], args))
    return out


def loads_calls(text: str) -> list[RawCall] | None:
    """`calls_from_json` of JSON text; None if it is not valid JSON."""
    try:
        return calls_from_json(json.loads(text))
    except ValueError:
        return None
