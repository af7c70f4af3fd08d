"""Qwen3-MoE and Qwen2-MoE (shared expert) from checkpoints transformers itself wrote
(tests/moe_checkpoints.py): config and tensors read through our loader (single file and
sharded), logits of ragged paged batches and greedy ids equal to transformers', and the
determinism promise: a token's output bits do not depend on its batch, nor on how many
other tokens chose the same experts."""

from __future__ import annotations

from typing import Any

import checkpoint_checks as checkpoints
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from checkpoint_checks import Checkpoint
from moe_checkpoints import ARCHS, make_model

from multiserve.model.families import family_for
from multiserve.model.invariance.calibration import default_plan
from multiserve.model.loading.loader import load_model

torch.set_num_threads(1)  # several busy threads on 2 shared cores slow torch 10x
CHECKPOINTS = checkpoints.Checkpoints(make_model)


def checkpoint(arch: str, factory: pytest.TempPathFactory) -> Checkpoint:
    """(transformers model, its single-file dir, its sharded dir), built once per arch."""
    return CHECKPOINTS.get(arch, factory)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_moe_checkpoint_loads_single_and_sharded(arch: str, tmp_path_factory) -> None:
    cfg = checkpoints.loaded_config(checkpoint(arch, tmp_path_factory), arch)
    hf = ARCHS[arch]
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (
        hf["num_experts"], 2, hf["moe_intermediate_size"])
    assert cfg.norm_topk_prob == hf["norm_topk_prob"]
    assert cfg.moe_layers == ((0, 2) if arch == "qwen3_moe" else (0, 1))
    assert cfg.shared_expert_intermediate_size == hf.get("shared_expert_intermediate_size", 0)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_moe_ragged_paged_batches_match_transformers(arch: str, tmp_path_factory) -> None:
    diff, scale = checkpoints.ragged_logits_diff(checkpoint(arch, tmp_path_factory))
    print(f"{arch}: max|diff|={diff:.2e} (max|logit|={scale:.2f})")
    assert scale > 1.0
    assert diff <= 1e-3


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_moe_greedy_ids_match_transformers_generate(arch: str, tmp_path_factory) -> None:
    got, want = checkpoints.greedy_ids_and_generates(checkpoint(arch, tmp_path_factory),
                                                     12)
    assert got == want
    assert len(set(got)) > 3  # a varied continuation, not one repeated token


def gather_plan(plan: Any) -> Any:
    """`plan` with every grouped expert product on the "gather" formulation (XLA: each row
    against its gathered expert matrix), the one used where the native kernel is not."""
    from dataclasses import replace

    from multiserve.model.invariance.plan import Formulation

    return replace(plan, products=tuple(
        replace(p, by_rows=tuple((m, Formulation("gather", m)) for m, _ in p.by_rows))
        if p.name.startswith("we_") else p for p in plan.products))


@pytest.mark.parametrize("kind", ["calibrated", "gather"])
def test_expert_rows_do_not_depend_on_who_else_chose_the_expert(kind: str,
                                                               tmp_path_factory) -> None:
    """One MoE layer's output for a fixed token, computed beside 0..255 other tokens that
    (by construction of the batch) crowd its experts or avoid them: bitwise the same; with
    the calibrated plan (here: the native grouped kernel) and with "gather"."""
    from multiserve.model.families.llama import layer_projection
    from multiserve.model.families.moe import moe_mlp
    from multiserve.model.families.moe_decoder import _select, moe_dense_matrices

    _, path, _ = checkpoint("qwen2_moe", tmp_path_factory)
    loaded = load_model(str(path), "float32")
    cfg = loaded.config
    plan = default_plan(cfg, np.float32)
    if kind == "gather":
        plan = gather_plan(plan)
    kernels = {plan.product(m).formulation(t).kernel for m in ("we_gate", "we_down")
               for t in (2, 128, 512)}
    print(f"{kind}: grouped kernels {kernels}")
    assert kernels == {"gather"} or kind == "calibrated"
    params = family_for(cfg).compute_params(jax.device_put(loaded.params), cfg, plan, ())
    rng = np.random.default_rng(0)
    probe = rng.standard_normal((1, cfg.hidden_size)).astype(np.float32)

    @jax.jit
    def layer0(h: jax.Array) -> jax.Array:
        w = _select(params["mlp"][0], params["mlp_stacked"]["moe"], moe_dense_matrices(cfg),
                    h.shape[0], plan, 0)
        for m in ("we_gate", "we_up", "we_down"):
            native = plan.product(m).formulation(h.shape[0] * 2).kernel == "native"
            w[m] = None if native else params["mlp"][0][m]
            w[f"{m}_p"] = params["mlp_stacked"]["moe"][f"{m}_p"] if native else None
        return moe_mlp(h, w, 0, layer_projection(w, 0, plan), cfg,
                       {m: plan.product(m) for m in ("we_gate", "we_up", "we_down")})

    alone = np.asarray(layer0(jnp.asarray(probe)))
    # candidates: many random tokens; keep the ones routed like the probe (same experts)
    pool = rng.standard_normal((4096, cfg.hidden_size)).astype(np.float32)
    router = np.asarray(loaded.params["moe"]["router"][0])
    top = np.argsort(-(pool @ router), axis=1)[:, :2]
    mine = set(np.argsort(-(probe @ router), axis=1)[0, :2])
    same = pool[[set(t) == mine for t in top]]
    other = pool[[not (set(t) & mine) for t in top]]
    assert len(same) >= 40 and len(other) >= 40
    for t in (2, 8, 64, 256):
        for crowd in (same, other, pool):
            batch = crowd[rng.permutation(len(crowd))[:t - 1]]
            for where in (0, len(batch) // 2, len(batch)):
                h = np.insert(batch, where, probe[0], axis=0)
                got = np.asarray(layer0(jnp.asarray(h)))[where]
                assert np.array_equal(got, alone[0]), (t, where)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_moe_logits_are_bitwise_batch_invariant(arch: str, tmp_path_factory) -> None:
    """test_batch_invariance's batchings (full prefill, mixed T=256 batch, chunked prefill,
    decode beside others at T = 64/128, lone T = 1 decode, small T = 2..8 steps) on the
    MoE model: the routed groups differ in every batching, the logits bits do not."""
    from test_batch_invariance import assert_bitwise_equal, run_modes

    _, path, _ = checkpoint(arch, tmp_path_factory)
    loaded = load_model(str(path), "float32")
    cfg = loaded.config
    rng = np.random.default_rng(5)
    target = [int(t) for t in rng.integers(3, cfg.vocab_size, 70)]
    probe = sorted({0, 1, 15, 16, 17, 40, 63, 64, 65, 69} | set(range(50, 55)))
    out = run_modes(jax.device_put(loaded.params), cfg, target, probe, page_size=4, block=16)
    assert_bitwise_equal(out, probe)
    assert not np.array_equal(out["prefill_T128"][0], out["prefill_T128"][69])


def test_calibration_checks_grouped_products_and_falls_back_to_gather() -> None:
    """The probe of a grouped product (rows at several positions inside groups of changing
    size): the native grouped kernel, where it builds, gives every row the same bits at
    every size (invariant by construction), and whatever wins the timing, the plan is
    verified: every size is served by a member of the anchor's class. On a backend whose
    native rows differ from size to size (distorted), native can serve a verified plan only
    as one size every step is padded to (the largest), never two native sizes nor native
    beside gather. Which kernel is faster is a timing fact (multiserve doctor shows it),
    not asserted here."""
    from multiserve.model.invariance.choice import select
    from multiserve.model.invariance.probes import probe_grouped as _probe_grouped
    from multiserve.model.invariance.workload import GroupedUse
    from multiserve.model.kernels import native as native_kernels

    use = GroupedUse("we_gate", 64, 32, 64, 32, experts=8, sizes=(2, 8, 32, 128))
    device = jax.devices()[0]
    native = native_kernels.unavailable_reason() is None
    for distort in (None, lambda prim, desc: prim == "grouped" and desc["kernel"] == "native"):
        cands = _probe_grouped(use, jnp.float32, device, distort, np.random.default_rng(0))
        assert {c.desc["kernel"] for c in cands} == ({"native", "gather"} if native
                                                     else {"gather"})
        sel = select(cands, use.sizes)
        assert sel.verified and sel.anchor is not None
        ref = sel.anchor.runs[0]
        assert all(c.agrees(ref) and c.rows >= m for m, c in sel.choice.items()), sel.choice
        kernels = {c.desc["kernel"] for c in sel.choice.values()}
        if distort is None:
            natives = [c for c in cands if c.desc["kernel"] == "native"]
            top = max(natives, key=lambda c: c.rows) if natives else None
            assert all(c.agrees(top.runs[0]) for c in natives)  # one class at every size
        elif kernels != {"gather"}:
            assert native and kernels == {"native"}, kernels
            assert {c.rows for c in sel.choice.values()} == {max(use.sizes)}, sel.choice
