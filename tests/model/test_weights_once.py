"""Weights held once (InvariancePlan.layer_copies off: an accelerator's plan): the compute
params hold no per-layer copy of a layer matrix and no copy of the head (a tied head is
the NT product against the embedding itself), the bytes an engine holds are the
checkpoint's, and the forward (unrolled at every size) gives bitwise the logits and K/V
of the plan with per-layer copies (XLA:CPU's: unrolled, then scanned), on a mixed step of
prefill chunks and decode rows. Run here on the CPU with XLA's products, as a TPU runs them.
The MoE families alike: attention, dense MLP, router, shared expert and biases held once,
read as static slices of the canonical stacks; the experts held once as per-layer stacks
(the canonical ones restacked from them bit for bit)."""

from __future__ import annotations

from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from model_helpers import TINY_LLAMA, forward_program, products_on

from multiserve.bench.random_model import SIZES
from multiserve.model.abstract_params import abstract_params
from multiserve.model.families import family_for
from multiserve.model.invariance.calibration import default_plan
from multiserve.model.invariance.plan import Formulation
from multiserve.model.invariance.primitives import LAYER_MATRICES
from multiserve.model.layers.forward_batch import ForwardBatch
from multiserve.model.layers.kv_pool import make_kv_pool
from multiserve.model.loading.param_layout import init_random_params
from multiserve.model.param_tree import get_leaf

PAGE, BLOCK, WIDTH = 4, 8, 40  # WIDTH: pages per sequence
PAGES = 1 + 3 * WIDTH


def _plan(cfg, copies: bool):  # type: ignore[no-untyped-def]
    """XLA's products (plain; a tied head NT), with or without per-layer copies."""
    plan = products_on(default_plan(cfg), "plain")
    if cfg.tie_word_embeddings:
        plan = replace(plan, products=tuple(
            replace(p, by_rows=tuple((m, Formulation("nt", m)) for m, _ in p.by_rows))
            if p.name == "head" else p for p in plan.products))
    return replace(plan, layer_copies=copies)


def _step(tokens: int) -> ForwardBatch:
    """A mixed step: a prefill chunk of sequence 0 (positions 0..tokens-3) and decode rows
    of sequences 1 and 2 (positions 9 and 17); each sequence on its own pages."""
    n = tokens - 2
    seq = np.array([0] * n + [1, 2], np.int32)
    pos = np.array(list(range(n)) + [9, 17], np.int32)
    table = 1 + WIDTH * np.arange(3, dtype=np.int32)[:, None] + np.arange(WIDTH, dtype=np.int32)
    slots = table[seq, pos // PAGE] * PAGE + pos % PAGE
    return ForwardBatch(input_ids=jnp.asarray((np.arange(tokens) * 7) % 256, jnp.int32),
                        positions=jnp.asarray(pos), token_seq=jnp.asarray(seq),
                        out_slots=jnp.asarray(slots, jnp.int32),
                        page_table=jnp.asarray(table),
                        seq_lens=jnp.asarray([n, 10, 18], jnp.int32),
                        logit_rows=jnp.asarray([n - 1, n, n + 1], jnp.int32))


def _assert_same_step(cfg, tokens: int, *runs) -> None:  # type: ignore[no-untyped-def]
    """The mixed step of `tokens` tokens under each (plan, compute params) of `runs`:
    bitwise the same logits and K/V."""
    fwd = forward_program(jnp.float32)
    outs = []
    for plan, compute in runs:
        pool = make_kv_pool(cfg, PAGES, PAGE, jnp.float32)
        logits, pool = fwd(compute, pool, _step(tokens), cfg=cfg, page_size=PAGE,
                           attn_block_size=BLOCK, plan=plan)
        outs.append([np.asarray(a) for a in (logits, pool.k, pool.v)])
    for out in outs[1:]:
        for a, b in zip(outs[0], out, strict=True):
            assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("tied", [True, False])
def test_one_layout_per_matrix_and_the_same_bits(tied: bool) -> None:
    cfg = replace(TINY_LLAMA, tie_word_embeddings=tied)
    family = family_for(cfg)
    params = jax.device_put(init_random_params(cfg, seed=5, scale=0.3))
    once, copies = _plan(cfg, False), _plan(cfg, True)
    # without copies the decoder is unrolled at every size (an accelerator's); with them
    # (XLA:CPU's) 128 tokens scan (llama.UNROLL_MAX_TOKENS): both forms, the same bits
    sizes = (8, 128)
    lean = family.compute_params(params, cfg, once, sizes)
    full = family.compute_params(params, cfg, copies, sizes)
    assert all(m not in layer and f"{m}_t" not in layer
               for layer in lean["layers"] for m in LAYER_MATRICES)
    assert all(lean["stacked_layers"][m] is params["layers"][m] for m in LAYER_MATRICES)
    assert lean["head_w" if tied else "head_wt"] is None  # no transposed head
    held = abstract_params(cfg, "float32", once)
    assert held.held_bytes == held.checkpoint_bytes
    assert abstract_params(cfg, "float32", copies).held_bytes > 1.5 * held.checkpoint_bytes
    for tokens in sizes:
        assert not family.scans(once, tokens)
        assert family.scans(copies, tokens) == (tokens == 128)
        _assert_same_step(cfg, tokens, (once, lean), (copies, full))


_TINY_MOE = dict(vocab_size=256, hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2,
                 head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                 intermediate_size=96, max_position_embeddings=256, sliding_window=8)
TINY_MOE = {
    # a dense layer among the sparse ones and a shared expert (Qwen2-MoE's)
    "qwen2_moe": replace(SIZES["small-mixtral"], architecture="qwen2_moe",
                         **{**_TINY_MOE, "sliding_window": 0},
                         moe_layers=(0, 2), shared_expert_intermediate_size=48,
                         sliding_layers=(), norm_topk_prob=False),
    "mixtral": replace(SIZES["small-mixtral"], **_TINY_MOE, moe_layers=(0, 1, 2),
                       sliding_layers=(0, 1, 2)),
    # attention and output biases, sinks, router and expert biases, float32 norms
    "gpt_oss": replace(SIZES["small-gpt-oss"], **_TINY_MOE, moe_layers=(0, 1, 2),
                       sliding_layers=(0, 2)),
}


def _moe_plan(cfg, copies: bool, experts: str, attention: str):  # type: ignore[no-untyped-def]
    """XLA's products: the expert products by `experts` ("gather", or "gmm": the TPU's
    grouped matmul, here in Pallas interpret mode), the others by `attention` ("plain" or
    "nt"; the head "nt")."""
    plan = default_plan(cfg)

    def kernel(name: str) -> str:
        return experts if name.startswith("we_") else "nt" if name == "head" else attention

    plan = replace(plan, products=tuple(
        replace(p, by_rows=tuple((m, Formulation(kernel(p.name), m)) for m, _ in p.by_rows))
        for p in plan.products))
    return replace(plan, layer_copies=copies)


@pytest.mark.parametrize("arch,experts,layout", [("qwen2_moe", "gather", "plain"),
                                                 ("mixtral", "gather", "nt"),
                                                 ("gpt_oss", "gmm", "plain")])
def test_moe_weights_held_once_and_the_same_bits(arch: str, experts: str,
                                                 layout: str) -> None:
    cfg = replace(TINY_MOE[arch], tie_word_embeddings=True)
    family = family_for(cfg)
    params = jax.device_put(init_random_params(cfg, seed=7, scale=0.3))
    once = _moe_plan(cfg, False, experts, layout)
    copies = _moe_plan(cfg, True, experts, layout)
    sizes = (8, 32)
    lean = family.compute_params(params, cfg, once, sizes)
    full = family.compute_params(params, cfg, copies, sizes)
    assert all(not layer for layer in lean["layers"])
    experts = family.grouped_shapes(cfg, 1, "tensor")
    names = {g.name for g in experts}
    # a MoE layer's own arrays: its expert stacks [E, in, out], the grouped products'
    # operands (a whole array: XLA:TPU copies a slice given to a custom call)
    assert all(set(lean["mlp"][i]) == (names if i in cfg.moe_layers else set())
               for i in range(cfg.num_layers))
    canonical = {id(a) for a in jax.tree.leaves(params)}
    own = {jax.tree_util.keystr(path): a for path, a in jax.tree.leaves_with_path(lean)
           if id(a) not in canonical and not jax.tree_util.keystr(path).startswith("['mlp']")}
    # the other arrays of their own: the stacked transposes "nt" reads (none with "plain")
    assert all(name.endswith("_t']") for name in own), sorted(own)
    assert bool(own) == (layout == "nt")
    held = abstract_params(cfg, "float32", once)
    assert held.held_bytes == held.checkpoint_bytes + sum(a.nbytes for a in own.values())
    assert abstract_params(cfg, "float32", copies).held_bytes > held.held_bytes
    # the expert stacks are held once, as the per-layer stacks: the canonical ones rebuilt
    kept = family.params_to_hold(params, lean)
    assert not names & set(kept["moe"])
    rebuilt = family.canonical_params(kept, lean, cfg)
    for path, a in jax.tree.leaves_with_path(params):
        assert np.asarray(get_leaf(rebuilt, tuple(k.key for k in path))).tobytes() == \
            np.asarray(a).tobytes()
    for name in names:
        assert np.asarray(family.canonical_leaf(kept, lean, cfg, ("moe", name))).tobytes() \
            == np.asarray(params["moe"][name]).tobytes()
    for tokens in sizes:
        _assert_same_step(cfg, tokens, (once, lean), (copies, full))
