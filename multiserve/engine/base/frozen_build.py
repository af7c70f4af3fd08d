"""`built(cls, **values)`: a frozen dataclass instance made without its `__init__`.

A frozen dataclass's generated `__init__` sets each field through `object.__setattr__`,
~0.1-0.3 us a field; the step path makes several such values per row per step (a
BatchRow, a RowSpec, an OutputDelta), so at 64 rows that alone was a few hundred
microseconds of each step's host work (docs/performance.md §23). `built` fills the new
instance's `__dict__` at once instead.

Invariants: only for frozen dataclasses without slots, without `__post_init__` and
without `InitVar`s; `values` names every field (its count is asserted here, its names
by tests/engine/test_host_path.py), so the result equals `cls(**values)` and stays
frozen (assignment still raises).
"""

from __future__ import annotations

from dataclasses import fields
from functools import cache
from typing import Any, TypeVar

T = TypeVar("T")


@cache
def field_count(cls: type) -> int:
    """How many fields `cls` has (every one must be given to `built`)."""
    assert not hasattr(cls, "__post_init__") and not hasattr(cls, "__slots__"), cls
    return len(fields(cls))


def built(cls: type[T], **values: Any) -> T:
    """`cls(**values)` (every field given) without the frozen `__init__`."""
    assert len(values) == field_count(cls), (cls.__name__, sorted(values))
    obj = object.__new__(cls)
    obj.__dict__.update(values)
    return obj
