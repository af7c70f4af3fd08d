"""The device side of one engine and its host bookkeeping (see docs/architecture.md §2)."""
