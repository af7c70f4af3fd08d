"""The choice among probed candidates (model/invariance/choice.py), on fabricated probe
results: candidates whose row hashes say which rows agree, with times chosen by the test.
No device, no kernel: the rules themselves (verified, one class per plan, fastest within
the tie rule, the fallbacks), never a claim about which real kernel is faster."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from multiserve.model.invariance.choice import (
    TIE,
    Candidate,
    attention_preference,
    bounded_seconds,
    choose_attention,
    choose_path,
    fastest,
    of_path,
    select,
    table_rows,
)

TOP = 8  # probe rows


def cand(rows: int, bits: str, seconds: float, kernel: str = "plain",
         moves: bool = False) -> Candidate:
    """A candidate over `rows` rows, run at two placements (the first and the last `rows`
    probe rows, as the probe places them). Rows computed alike (the same `bits`) hash alike;
    `moves`: row 0's bits change with its position (not position-invariant)."""
    def h(i: int, run: int) -> int:
        return hash((bits, i, run if moves and i == 0 else 0))

    runs = [{i: h(i, 0) for i in range(rows)},
            {i: h(i, 1) for i in range(TOP - rows, TOP)}]
    return Candidate({"kernel": kernel, "rows": rows}, rows, runs, seconds)


def path_cand(rows: int, path: str, seconds: float) -> Candidate:
    """A native candidate of instruction path `path` (each path its own bits)."""
    c = cand(rows, f"native-{path}", seconds, kernel="native")
    c.desc["path"] = path
    return c


def test_one_path_serves_every_product_and_size_the_cheapest_over_all_of_them() -> None:
    """Path "a" is fastest at one row, "b" at eight; b's plans cost least summed over both
    products (each size's time over the fastest there): b everywhere, never a mix, and no
    native candidate of path a in b's plan. XLA's own formulations stay candidates."""
    sizes = (1, 8)
    first = [path_cand(1, "a", 1.0), path_cand(8, "a", 9.0), path_cand(1, "b", 1.1),
             path_cand(8, "b", 3.0), cand(1, "xla", 5.0), cand(8, "xla", 20.0)]
    second = [path_cand(1, "a", 2.0), path_cand(8, "a", 8.0), path_cand(1, "b", 2.1),
              path_cand(8, "b", 4.0)]
    path, costs = choose_path([(first, sizes), (second, sizes)], ("a", "b"))
    assert path == "b" and costs["b"] < costs["a"]
    for cands in (first, second):
        sel = select(of_path(cands, path), sizes)
        assert {c.desc.get("path") for c in sel.choice.values()} == {"b"}
    assert [c.desc["kernel"] for c in of_path(first, "a")].count("native") == 2
    assert all(c.desc.get("path") != "b" for c in of_path(first, "a"))


def test_a_single_path_is_chosen_without_timing() -> None:
    assert choose_path([([path_cand(1, "w", 1.0)], (1,))], ("w",)) == ("w", {})
    assert choose_path([([cand(1, "xla", 1.0)], (1,))], ("",)) == ("", {})


def one_class(sel) -> bool:  # noqa: ANN001
    """Every chosen candidate agrees with the anchor."""
    ref = sel.anchor.runs[0]
    return all(c.agrees(ref) for c in sel.choice.values())


def test_choice_module_needs_no_device() -> None:
    code = ("import sys, multiserve.model.invariance.choice; "
            "assert 'jax' not in sys.modules, 'choice imports jax'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_size_is_served_by_a_verified_member_able_to_hold_it() -> None:
    cands = [cand(1, "a", 1.0), cand(2, "a", 1.0), cand(4, "a", 1.0), cand(8, "a", 1.0)]
    sel = select(cands, [1, 3, 8])
    assert sel.verified and sel.anchor is cands[3]
    assert {m: c.rows for m, c in sel.choice.items()} == {1: 1, 3: 4, 8: 8}


def test_a_faster_member_wins_beyond_the_tie_and_the_smaller_within_it() -> None:
    small, big = cand(4, "a", 1.0), cand(8, "a", 1.0 / (TIE * 1.5))
    assert select([small, big], [4, 8]).choice[4] is big  # clearly faster: padded to 8
    small, big = cand(4, "a", 1.0), cand(8, "a", 1.0 / (TIE * 0.9))
    assert select([small, big], [4, 8]).choice[4] is small  # within the tie: less padding


def test_within_the_tie_plain_is_preferred_to_nt() -> None:
    nt, plain = cand(4, "a", 1.0, "nt"), cand(4, "a", 1.0 * TIE * 0.99, "plain")
    assert fastest([nt, plain]) is plain
    assert fastest([nt, cand(4, "a", TIE * 1.5, "plain")]) is nt


def test_within_the_tie_native_is_preferred_to_xla() -> None:
    plain, nt = cand(4, "a", 1.0, "plain"), cand(4, "a", 1.0, "nt")
    native = cand(4, "a", 1.0 * TIE * 0.99, "native")
    assert fastest([plain, nt, native]) is native
    assert fastest([plain, nt, cand(4, "a", TIE * 1.5, "native")]) is plain
    assert fastest([plain, cand(8, "a", 0.9, "native")]) is plain  # fewer rows first


def test_a_native_probe_slower_at_fewer_rows_is_read_as_noise() -> None:
    """The native kernel at 4 rows timed slower than at 8 (a noisy probe: its work at 4
    rows is a subset of its work at 8): 4 rows are served by the 4-row candidate, not
    padded to 8; an XLA formulation's times are read as measured."""
    small, big = cand(4, "a", 1.0, "native"), cand(8, "a", 0.5, "native")
    t = bounded_seconds([small, big])
    assert t[id(small)] == 0.5 and t[id(big)] == 0.5
    sel = select([small, big], [4, 8])
    assert sel.choice[4] is small and sel.choice[8] is big
    rows = table_rows("product", {}, [small, big], sel)
    assert [r["chosen_for"] for r in rows] == [[4], [8]]
    assert [r["ms"] for r in rows] == [1000.0, 500.0]  # the table shows what was timed
    xs, xb = cand(4, "a", 1.0, "plain"), cand(8, "a", 0.5, "plain")
    assert bounded_seconds([xs, xb])[id(xs)] == 1.0
    assert select([xs, xb], [4, 8]).choice[4] is xb


def test_the_native_bound_stays_within_one_formulation() -> None:
    """Only the same native formulation at more rows bounds a time: another path (its
    own bits) or another matrix never does."""
    a4, b8 = path_cand(4, "a", 1.0), path_cand(8, "b", 0.5)
    t = bounded_seconds([a4, b8])
    assert t[id(a4)] == 1.0
    a8 = path_cand(8, "a", 0.25)
    t = bounded_seconds([a4, b8, a8])
    assert t[id(a4)] == 0.25 and t[id(b8)] == 0.5
    path, _ = choose_path([([a4, a8, path_cand(4, "b", 0.3), b8], (4, 8))], ("a", "b"))
    assert path == "a"
    wq4, wk8 = path_cand(4, "a", 1.0), path_cand(8, "a", 0.25)
    wq4.desc["name"], wk8.desc["name"] = "wq", "wk"
    assert bounded_seconds([wq4, wk8])[id(wq4)] == 1.0


def test_sizes_never_mix_formulations_whose_rows_differ() -> None:
    """Per size the fastest candidate would come from two classes (b fast at 1 row, a fast
    at 8 rows): a plan takes every size from one anchor's class."""
    a1, a8 = cand(1, "a", 5.0), cand(8, "a", 1.0)
    b1, b8 = cand(1, "b", 1.0), cand(8, "b", 5.0)
    cands = [a1, a8, b1, b8]
    sel = select(cands, [1, 8])
    assert sel.verified and one_class(sel)
    assert sel.choice[1] is a8 and sel.choice[8] is a8  # b1, as fast, is of the other class


def test_the_cheapest_class_wins() -> None:
    a = [cand(1, "a", 3.0), cand(8, "a", 3.0)]
    b = [cand(1, "b", 1.0), cand(8, "b", 1.0)]
    sel = select(a + b, [1, 8])
    assert sel.anchor is b[1] and sel.choice == {1: b[0], 8: b[1]}


def test_a_candidate_disagreeing_with_the_reference_is_never_chosen() -> None:
    """Every smaller candidate sums in its own order (distorted): the last resort, every
    step padded to the reference's size, is what remains, and it is verified."""
    cands = [cand(1, "x1", 0.1), cand(2, "x2", 0.1), cand(4, "x4", 0.1), cand(8, "a", 9.0)]
    sel = select(cands, [1, 2, 4, 8])
    assert sel.verified and all(c is cands[3] for c in sel.choice.values())


def test_a_reference_whose_rows_move_is_no_reference() -> None:
    moving, steady = cand(8, "a", 0.1, moves=True), cand(8, "b", 9.0)
    sel = select([cand(1, "a", 0.1), moving, cand(1, "b", 1.0), steady], [1, 8])
    assert sel.verified and sel.anchor is steady


def test_nothing_position_invariant_falls_back_to_the_fastest_unverified() -> None:
    cands = [cand(1, "a", 2.0), cand(2, "b", 1.0), cand(8, "c", 3.0, moves=True)]
    sel = select(cands, [1, 2, 8])
    assert not sel.verified and sel.anchor is None
    assert {m: c.rows for m, c in sel.choice.items()} == {1: 2, 2: 2, 8: 8}


def test_attention_preference_orders_by_padding_then_chunk() -> None:
    assert attention_preference(5, 16, (1, 2, 4, 8, 16)) == [
        (1, 5), (2, 6), (4, 8), (8, 8), (16, 16)]
    assert attention_preference(16, 16, (1, 2, 4, 8, 16)) == [
        (16, 16), (8, 16), (4, 16), (2, 16), (1, 16)]
    assert attention_preference(3, 4, (1, 2, 4, 8)) == [(1, 3), (2, 4), (4, 4)]


class FakeAttention:
    """Attention candidates made on demand, each once: `bits(tokens, chunk, padded, shared,
    kernel)` names how a candidate computes its rows; `asked` records what was made."""

    def __init__(self, bits, moves=lambda *k: False) -> None:  # noqa: ANN001
        self.bits, self.moves, self.asked = bits, moves, []
        self.made: dict = {}

    def xla(self, tokens: int, chunk: int, padded: int, shared: bool) -> Candidate:
        return self._make(tokens, chunk, padded, shared, "xla")

    def native(self, tokens: int) -> Candidate:
        return self._make(tokens, 1, tokens, False, "native")

    def _make(self, *key) -> Candidate:  # noqa: ANN002
        if key not in self.made:  # made once, as the probe makes them
            self.asked.append(key)
            c = cand(key[0], self.bits(*key), 1.0, moves=self.moves(*key))
            c.desc = {"kernel": key[4], "tokens": key[0], "chunk": key[1], "padded": key[2],
                      "shared_keys": key[3]}
            self.made[key] = c
        return self.made[key]


CHUNKS = (1, 2, 4, 8)


def test_attention_takes_the_native_kernel_when_its_rows_agree_at_every_size() -> None:
    fake = FakeAttention(lambda *k: "native" if k[4] == "native" else "xla")
    sel, shared, kernel = choose_attention((1, 4, 8), CHUNKS, fake.native, fake.xla)
    assert kernel == "native" and sel.verified and not shared
    assert {t: c.desc["kernel"] for t, c in sel.choice.items()} == dict.fromkeys((1, 4, 8),
                                                                                 "native")
    assert all(k[4] == "native" for k in fake.asked)  # no XLA candidate probed


def test_attention_leaves_a_native_kernel_whose_rows_differ_by_size(
        caplog: pytest.LogCaptureFixture) -> None:
    fake = FakeAttention(lambda *k: f"native{k[0]}" if k[4] == "native" else "xla")
    with caplog.at_level(logging.WARNING, "multiserve.calibration"):
        sel, shared, kernel = choose_attention((1, 4, 8), CHUNKS, fake.native, fake.xla)
    assert kernel == "xla" and sel.verified and "not invariant" in caplog.text
    # the first reference in preference order: the largest chunk, shared keys first
    assert sel.anchor.desc == {"kernel": "xla", "tokens": 8, "chunk": 8, "padded": 8,
                               "shared_keys": True} and shared
    assert {t: c.desc["chunk"] for t, c in sel.choice.items()} == {1: 1, 4: 4, 8: 8}


def test_attention_sizes_whose_chunks_differ_take_the_first_agreeing_chunk() -> None:
    """Chunks of 1 and 2 rows compute differently (an alien backend): every size takes
    the first candidate in its preference order whose rows agree (a 1-token step: a chunk
    of 4, the token padded to 4)."""
    fake = FakeAttention(lambda *k: f"c{k[1]}" if k[1] <= 2 else "xla")
    sel, _, kernel = choose_attention((1, 2, 4, 8), CHUNKS, None, fake.xla)
    assert kernel == "xla" and sel.verified
    assert {t: (c.desc["chunk"], c.desc["padded"]) for t, c in sel.choice.items()} == {
        1: (4, 4), 2: (4, 4), 4: (4, 4), 8: (8, 8)}
    assert all(c.agrees(sel.anchor.runs[0]) for c in sel.choice.values())


def test_attention_sizes_with_no_agreeing_candidate_are_padded_to_the_reference() -> None:
    fake = FakeAttention(lambda *k: "xla" if k[0] == 8 else f"t{k[0]}c{k[1]}")
    sel, _, _ = choose_attention((1, 4, 8), CHUNKS, None, fake.xla)
    assert sel.verified and all(c is sel.anchor for c in sel.choice.values())


def test_attention_without_shared_keys_when_shared_keys_move_rows() -> None:
    fake = FakeAttention(lambda *k: "xla", moves=lambda *k: k[3])
    sel, shared, _ = choose_attention((1, 8), CHUNKS, None, fake.xla)
    assert sel.verified and not shared
    assert not any(c.desc["shared_keys"] for c in sel.choice.values())


def test_attention_with_no_invariant_reference_is_not_verified() -> None:
    fake = FakeAttention(lambda *k: "xla", moves=lambda *k: True)
    sel, shared, kernel = choose_attention((1, 8), CHUNKS, None, fake.xla)
    assert not sel.verified and sel.anchor is None and kernel == "xla" and not shared


def test_the_table_marks_reference_members_and_sizes() -> None:
    cands = [cand(1, "a", 1.0), cand(1, "x", 0.5), cand(8, "a", 1.0)]
    sel = select(cands, [1, 8])
    rows = table_rows("product", {"name": "wq"}, cands, sel)
    assert [r["reference"] for r in rows] == [False, False, True]
    assert [r["matches_reference"] for r in rows] == [True, False, True]
    assert [r["chosen_for"] for r in rows] == [[1], [], [8]]
    assert all(r["position_invariant"] and r["name"] == "wq" for r in rows)
