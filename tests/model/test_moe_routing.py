"""Routing replay at the model level: the top-k expert ids a MoE family's forward returns
(`forward_routed`, [T, MoE layers, k]) are the ones transformers' router picks for the same
tokens, position by position, whether the sequence runs in one chunk or several; keeping
them changes no logit bit; a dense family has none to return."""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import numpy as np
import pytest
import torch
from model_helpers import TINY_LLAMA
from moe_checkpoints import ARCHS, hf_router_topk, make_model, save

from multiserve.model.families import family_for
from multiserve.model.families.forward import forward, forward_routed
from multiserve.model.invariance.calibration import default_plan
from multiserve.model.layers.kv_pool import make_kv_pool
from multiserve.model.loading.loader import load_model
from multiserve.model.simple_generate import single_sequence_batch

torch.set_num_threads(1)  # several busy threads on 2 shared cores slow torch 10x
PAGE = 4
STATIC = ("cfg", "page_size", "attn_block_size", "plan")


def hf_routing(model: Any, tokens: list[int]) -> np.ndarray:
    """[len(tokens), MoE layers, k]: the expert ids each MoE layer's router of the
    transformers model chose (a hook on every `mlp.gate`: its third output, the top-k
    indices, in the router's rank order)."""
    got = hf_router_topk(model, tokens)
    return np.stack([got[i] for i in sorted(got)], axis=1).astype(np.int32)


def run_chunks(fn: Any, params: Any, cfg: Any, plan: Any, tokens: list[int],
               chunks: list[int]) -> list[tuple]:
    """`fn` (jitted forward / forward_routed) over `tokens` in consecutive chunks."""
    pages = np.arange(1, -(-len(tokens) // PAGE) + 1, dtype=np.int32)
    kv = make_kv_pool(cfg, len(pages) + 1, PAGE, jax.tree.leaves(params)[0].dtype)
    outs, start = [], 0
    for n in chunks:
        out = fn(params, kv, single_sequence_batch(tokens[start:start + n], start, pages, PAGE),
                 cfg=cfg, page_size=PAGE, attn_block_size=8, plan=plan)
        kv = out[1]
        outs.append((n, out))
        start += n
    return outs


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_routed_experts_match_transformers_router(arch: str, tmp_path) -> None:
    model = make_model(arch, seed=3)
    loaded = load_model(str(save(model, tmp_path / arch)), "float32")
    cfg = loaded.config
    tokens = [int(t) for t in np.random.default_rng(4).integers(3, cfg.vocab_size, 21)]
    want = hf_routing(model, tokens)
    assert want.shape == (21, len(cfg.moe_layers), cfg.num_experts_per_tok)
    assert len(np.unique(want)) > 2  # the tokens spread over the experts
    plan = default_plan(cfg, jax.numpy.float32, page_size=PAGE, block_size=8)
    params = family_for(cfg).compute_params(jax.device_put(loaded.params), cfg, plan, ())
    routed = jax.jit(forward_routed, static_argnames=STATIC)
    plain = jax.jit(forward, static_argnames=STATIC)
    for chunks in ([21], [13, 1, 7]):  # one prefill; a chunked prefill, a decode, the rest
        got = np.concatenate([np.asarray(out[2])[:n]
                              for n, out in run_chunks(routed, params, cfg, plan, tokens,
                                                       chunks)])
        np.testing.assert_array_equal(got, want, err_msg=f"{arch} chunks={chunks}")
        # keeping the ids changes nothing: the same logits, bit for bit
        with_ids = run_chunks(routed, params, cfg, plan, tokens, chunks)
        without = run_chunks(plain, params, cfg, plan, tokens, chunks)
        for (_, a), (_, b) in zip(with_ids, without, strict=True):
            assert np.asarray(a[0]).tobytes() == np.asarray(b[0]).tobytes()


def test_dense_family_has_no_routed_experts() -> None:
    family = family_for(TINY_LLAMA)
    call = partial(family.forward_hidden_routed, {}, None, None, TINY_LLAMA, page_size=PAGE,
                   attn_block_size=8, plan=None)
    with pytest.raises(ValueError, match="dense"):
        call()
