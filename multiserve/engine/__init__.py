"""The device side of one engine and its host bookkeeping (see DESIGN.md §2)."""
