"""PageAllocator and the page helpers (engine/sched/page_allocator.py): no model, no jax."""

from __future__ import annotations

import numpy as np
import pytest

from multiserve.engine.sched.page_allocator import PageAllocator, pages_needed, slots_for


def test_page_zero_is_never_handed_out_and_low_ids_come_first() -> None:
    a = PageAllocator(5, 4)
    assert a.num_usable == 4 and a.num_free == 4
    assert a.allocate(2) == [1, 2]
    assert a.allocate(0) == []
    assert a.allocate(2) == [3, 4]
    assert a.num_free == 0 and not a.can_allocate(1) and a.can_allocate(0)


def test_check_and_action_are_paired() -> None:
    a = PageAllocator(3, 4)
    assert a.can_allocate(2) and not a.can_allocate(3)
    with pytest.raises(AssertionError, match="allocate"):
        a.allocate(3)
    assert a.num_free == 2  # a refused allocation takes nothing


def test_freed_pages_come_back_in_free_order_before_untouched_ones() -> None:
    a = PageAllocator(8, 4)
    pages = a.allocate(5)  # 1..5; 6, 7 untouched
    a.free([pages[3], pages[1]])  # 4, then 2
    assert a.num_free == 4
    assert a.allocate(3) == [4, 2, 6]


@pytest.mark.parametrize("bad", [[0], [1, 1], [3, 3]])
def test_bad_frees_are_caught(bad: list[int]) -> None:
    a = PageAllocator(5, 4)
    a.allocate(2)  # 1, 2 in use; 3 is free
    with pytest.raises(AssertionError):
        a.free(bad)


def test_double_free_is_caught() -> None:
    a = PageAllocator(5, 4)
    (p,) = a.allocate(1)
    a.free([p])
    with pytest.raises(AssertionError, match="double free"):
        a.free([p])


def test_reset_gives_every_page_back() -> None:
    a = PageAllocator(9, 2)
    a.allocate(5)
    a.reset()
    assert a.num_free == 8 and a.allocate(8) == list(range(1, 9))


def test_needs_page_zero_and_one_more() -> None:
    with pytest.raises(AssertionError):
        PageAllocator(1, 4)


def test_pages_needed_and_slots() -> None:
    assert [pages_needed(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    # positions [2, 7) over pages [5, 2]: 5*4+2, 5*4+3, 2*4+0, 2*4+1, 2*4+2
    np.testing.assert_array_equal(slots_for([5, 2], 2, 7, 4), [22, 23, 8, 9, 10])
