"""A token's logits are BITWISE identical however it is batched: one full prefill, chunked
prefill (various chunk sizes), token-by-token decode, and the same sequence at other rows
next to other sequences, with T from 1 to 256 tokens and R from 1 to 128 logits rows
(the engine's buckets: a lone decode is a T = R = 1 step)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from model_helpers import TINY_LLAMA, PagedSim, every_layout

from multiserve.config import ModelConfig
from multiserve.model.loading.loader import numpy_dtype
from multiserve.model.loading.param_layout import init_random_params


def run_modes(params, cfg: ModelConfig, target: list[int], probe: list[int], *,
              page_size: int, block: int) -> dict[str, dict[int, np.ndarray]]:
    """Logits at the `probe` positions of `target`, computed in several batchings."""
    rng = np.random.default_rng(123)
    params = every_layout(params, cfg)  # once, for every simulator below
    n = len(target)
    others = {f"o{i}": [int(t) for t in rng.integers(3, cfg.vocab_size, int(rng.integers(50, 90)))]
              for i in range(6)}
    want = {"x": probe}
    out: dict[str, dict[int, np.ndarray]] = {}

    def sim() -> PagedSim:
        # 7 sequences of <= 634 tokens in all (<= 166 pages of 4), scattered over the pool
        s = PagedSim(params, cfg, page_size=page_size, block_size=block, num_pages=256,
                     max_pages=64, seed=int(rng.integers(1 << 30)))
        s.add("x", target)
        for k, v in others.items():
            s.add(k, v)
        return s

    def collect(got: dict) -> dict[int, np.ndarray]:
        return {p: v for (name, p), v in got.items() if name == "x"}

    # 1. one full prefill, alone, T=128 (row 0)
    s = sim()
    out["prefill_T128"] = collect(s.step([("x", n)], T=128, logits_for=want))
    # 2. full prefill at T=256 next to other sequences' prefills, rows shuffled, R=B=128
    s = sim()
    work = [("o0", len(others["o0"])), ("x", n), ("o1", len(others["o1"]))]
    out["mixed_T256_R128"] = collect(s.step(work, T=256, B=128, R=128, rows=rng,
                                            seq_rows={"x": 77}, logits_for=want))
    # 3. chunked prefill with assorted chunk sizes, others decoding alongside, T=64
    s = sim()
    for k in ("o2", "o3"):
        s.step([(k, len(others[k]) - 3)], T=128)
    got: dict = {}
    done, sizes = 0, [7, 30, 1, 13, 64, 2, 17]
    for i, size in enumerate(sizes * 10):
        size = min(size, n - done, 62)
        if size <= 0:
            break
        work = [("x", size)] + [(k, 1) for k in ("o2", "o3") if s.seqs[k].kv_len < len(others[k])]
        got.update(s.step(work, T=64, rows=np.random.default_rng(i), seq_rows={"x": 3 + i % 5},
                          logits_for=want))
        done += size
    out["chunked_T64"] = collect(got)
    # 4. prefill a prefix, then token-by-token decode beside other decoding sequences,
    #    alternating T between 64 and 128 and B=R between 64 and 128
    s = sim()
    first = probe[0] + 1
    got = s.step([("x", first), ("o4", 40)], T=128, logits_for=want)
    for i in range(first, n):
        big = i % 2 == 0
        work = [(k, 1) for k in ("o4", "o5") if 0 < s.seqs[k].kv_len < len(others[k])]
        work.insert(i % (len(work) + 1), ("x", 1))
        got.update(s.step(work, T=128 if big else 64, B=128 if big else 64,
                          R=128 if big else 64, rows=np.random.default_rng(i),
                          logits_for=want))
        if i == first + 3:
            s.step([("o5", min(50, len(others["o5"]) - 1))], T=64)
    out["decode_T64_T128"] = collect(got)
    # 5. small steps: chunked prefill in T=32/16 steps, then decode alone (T = B = R = 1)
    #    alternating with decode beside 1..7 other sequences at T = 2/4/8 and R = 2..8
    s = sim()
    got, done = {}, 0
    while done < probe[0] + 1:
        size = min(probe[0] + 1 - done, 32 if done % 2 == 0 else 16)
        got.update(s.step([("x", size)], T=32, B=32, R=1, logits_for=want))
        done += size
    s.step([(k, len(others[k]) - 8) for k in ("o0", "o1", "o2", "o3")], T=512, B=4, R=4)
    for i in range(done, n):
        if i % 2 == 0:
            got.update(s.step([("x", 1)], T=1, B=1, R=1, logits_for=want))
            continue
        k = 1 + (i // 2) % 4
        work = [(name, 1) for name in ("o0", "o1", "o2", "o3")[:k - 1]]
        for name, _ in work:  # keep the others' lengths in range
            s.seqs[name].kv_len -= 1
        work.insert(i % k, ("x", 1))
        rows = 1 << (k - 1).bit_length()
        got.update(s.step(work, T=max(2, rows), B=max(2, rows), R=max(2, rows),
                          rows=np.random.default_rng(i), logits_for=want))
    out["small_T1_T8"] = collect(got)
    return out


def assert_bitwise_equal(out: dict[str, dict[int, np.ndarray]], probe: list[int]) -> None:
    ref_name = "prefill_T128"
    for name, got in out.items():
        assert sorted(got) == sorted(probe), name
        for p in probe:
            same = np.array_equal(got[p], out[ref_name][p])
            assert same, (f"{name} differs from {ref_name} at position {p}: max|diff| = "
                          f"{np.max(np.abs(got[p] - out[ref_name][p]))}")


@pytest.mark.parametrize("page_size,block,dtype", [(4, 16, "float32"), (16, 128, "float32"),
                                                   (16, 128, "bfloat16")])
def test_tiny_model_logits_are_bitwise_batch_invariant(page_size: int, block: int,
                                                       dtype: str) -> None:
    cfg = TINY_LLAMA
    params = jax.device_put(jax.tree.map(lambda a: a.astype(numpy_dtype(dtype)),
                                         init_random_params(cfg, seed=7, scale=0.3)))
    rng = np.random.default_rng(5)
    target = [int(t) for t in rng.integers(3, cfg.vocab_size, 100)]
    probe = sorted({0, 1, 15, 16, 17, 40, 63, 64, 65, 80, 98, 99} | set(range(50, 60)))
    out = run_modes(params, cfg, target, probe, page_size=page_size, block=block)
    assert_bitwise_equal(out, probe)
    # and the logits are real: not all equal across positions
    assert not np.array_equal(out["prefill_T128"][0], out["prefill_T128"][99])


@pytest.mark.slow
def test_default_model_logits_are_bitwise_batch_invariant(default_model) -> None:
    params = jax.device_put(default_model.params)
    rng = np.random.default_rng(9)
    target = [int(t) for t in rng.integers(20, 40000, 24)]
    probe = list(range(16, 24))
    out = run_modes(params, default_model.config, target, probe, page_size=16, block=128)
    assert_bitwise_equal(out, probe)
