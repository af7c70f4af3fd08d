"""`multiserve doctor --target tpu --compile [--topology v5e:2x2] [--tp N]`: every step
program an engine would run on a TPU, compiled by the real TPU compiler from this CPU
(model/target_compile.py), for the model `--model` names (default: the embedded default
model) and the random 1B and 8B shapes (bench/random_model.py), and what each holds and
moves.

Per program (every FORWARD token bucket, the HEAD's logits and sampler programs, every
FUSED step and, K = 4 decode steps, every DECODE_STEPS program; doctor/steps.py): HBM per chip
(arguments, outputs, temporaries, and the outputs aliased to donated arguments: the KV
pool), the compiler's bytes accessed and flops, the floor and the ratio of the two, the
largest contributors by op and the collectives (model/hlo_ops.py).

The floor of a program is what it cannot move less than, per chip: the weights it reads,
once (a forward: every layer, and its tokens' embedding rows; a head: the head matrix),
the K/V in use (every sequence row of the step at `--context` tokens, the whole page
table: the programs are compiled with tables of context / page_size pages) and written
(the step's tokens), and the logits (float32, written once). A DECODE_STEPS program's
loop body is counted once by the compiler: its floor is one decode step's.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

# HBM per chip by device kind (Google Cloud's published figures, GiB); a compile-only
# device reports none, and the compiler compiles a program larger than its chip
HBM_PER_CHIP = {"TPU v5 lite": 16 << 30, "TPU v6 lite": 32 << 30, "TPU v5": 95 << 30,
                "TPU v4": 32 << 30}
DEFAULT_CONTEXT = 1024
DEFAULT_KV_PAGES = 4096
DECODE_STEPS = 4
GB = 1e9


def _floor(cfg: Any, dtype: str, kind: str, tokens: int, rows: int, canonical: Any,
           context: int, kv_shards: int) -> int:
    """A program's floor per chip, in bytes (module docstring)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from multiserve.model.layers.kv_pool import kv_bytes_per_token

    def chip(a: Any) -> int:
        shape = a.sharding.shard_shape(a.shape) if a.sharding is not None else a.shape
        return int(np.prod(shape)) * jnp.dtype(a.dtype).itemsize

    item = jnp.dtype(dtype).itemsize
    per_token = kv_bytes_per_token(cfg, dtype) // kv_shards
    layers = sum(chip(a) for a in jax.tree.leaves(canonical["layers"]))
    head = chip(canonical["embed"] if cfg.tie_word_embeddings else canonical["lm_head"])
    logits = rows * cfg.vocab_size * 4
    forward = (layers + tokens * cfg.hidden_size * item
               + per_token * (rows * context + tokens) + rows * cfg.hidden_size * item)
    return {"forward": forward, "logits": head + logits, "sampler": logits,
            "fused": forward + head + logits, "steps": forward + head + logits}[kind]


def _program_json(p: Any, cost: Any, floor: int, hbm: int | None) -> dict[str, Any]:
    out: dict[str, Any] = {"kind": p.kind, "size": p.size, "tokens": p.tokens, "rows": p.rows,
                           "scanned": p.scanned, "seconds": round(cost.seconds, 1),
                           "compiled": cost.error is None, "error": cost.error}
    if cost.error is not None:
        return out
    h, ops = cost.hbm, cost.ops
    out.update({
        "hbm": {"arguments": h.arguments, "outputs": h.outputs, "temporaries": h.temporaries,
                "aliased": h.aliased, "code": h.code, "peak": h.peak,
                "fits": None if hbm is None else h.peak <= hbm},
        "bytes_accessed": cost.bytes_accessed, "flops": cost.flops, "floor": floor,
        "ratio": round(cost.bytes_accessed / floor, 3) if floor else None,
        "pallas_calls": ops.pallas_calls, "loops": ops.loops,
        "top_ops": [{"op": o.label, "count": o.count, "bytes": o.bytes} for o in ops.ops],
        "collectives": [{"op": c.opcode, "dtype": c.dtype, "bytes": c.bytes,
                         "times": c.times} for c in ops.collectives]})
    return out


def compile_model(label: str, cfg: Any, dtype: str, topology: str, tp: int, *,
                  ec: Any = None, context: int = DEFAULT_CONTEXT,
                  kv_pages: int = DEFAULT_KV_PAGES, which: Any = None) -> dict[str, Any]:
    """The compile report of one model config (module docstring): its programs `which`
    ((kind, size) pairs; None: every program of an engine of `ec`, default EngineConfig())
    compiled for the first `tp` chips of `topology`."""
    import jax.numpy as jnp
    import numpy as np

    from multiserve.config import EngineConfig
    from multiserve.doctor.steps import engine_programs, step_programs
    from multiserve.model.abstract_params import abstract_params, canonical_shapes
    from multiserve.model.invariance.workload import default_workload
    from multiserve.model.invariance.xla_options import step_options
    from multiserve.model.layers.kv_pool import kv_bytes_per_token, pool_layout, pool_shape
    from multiserve.model.sharding import attention_sharded, make_mesh
    from multiserve.model.target_compile import compile_cost, topology_devices
    from multiserve.model.target_export import target_plan

    ec = ec or EngineConfig()
    devices = topology_devices(topology)
    if tp > len(devices):
        raise ValueError(f"--tp {tp}: topology {topology} has {len(devices)} chips")
    mesh = make_mesh(devices[:tp])
    # the workload of the engine's TP degree: its local product shapes, and whether a MoE
    # model's experts are split over the chips (then no grouped matmul: gmm_usable)
    workload = default_workload(cfg, dtype, page_size=ec.page_size,
                                block_size=ec.attention_block_size, tp=tp)
    plan = target_plan(workload, "tpu", cfg.tie_word_embeddings)
    params = abstract_params(cfg, dtype, plan, mesh)
    canonical = canonical_shapes(cfg, dtype, mesh)
    kv_shards = tp if attention_sharded(cfg, mesh) else 1
    max_pages = -(-context // ec.page_size)
    programs = step_programs(cfg, dtype, plan, ec, mesh, params.compute,
                             which if which is not None else engine_programs(ec, True),
                             max_pages=max_pages, num_pages=kv_pages,
                             decode_steps=DECODE_STEPS)
    options = step_options("tpu", str(jnp.dtype(dtype)))
    rows = []
    for p in programs:
        cost = compile_cost(p.fn, p.args, p.static, options)
        rows.append(_program_json(p, cost, _floor(cfg, dtype, p.kind, p.tokens, p.rows,
                                                  canonical, context, kv_shards),
                                  HBM_PER_CHIP.get(devices[0].device_kind)))
    # what the pool holds in HBM: its values, and the zero lanes of a padded "lanes" row
    # (kv_pool.lanes_width); the floors count the values
    layout = pool_layout(plan.attention.kernel)
    kv_total = 2 * int(np.prod(pool_shape(cfg, kv_pages * ec.page_size, layout,
                                          attention_sharded(cfg, mesh)))) \
        * jnp.dtype(dtype).itemsize
    kv_values = kv_pages * ec.page_size * kv_bytes_per_token(cfg, dtype)
    return {
        "model": label, "dtype": dtype, "topology": topology,
        "device_kind": devices[0].device_kind, "tp": tp, "context": context,
        "hbm_per_chip": HBM_PER_CHIP.get(devices[0].device_kind),
        "shape": {"layers": cfg.num_layers, "hidden": cfg.hidden_size,
                  "heads": cfg.num_heads, "kv_heads": cfg.num_kv_heads,
                  "head_dim": cfg.head_dim, "vocab": cfg.vocab_size},
        "attention": plan.attention.kernel,
        # the kernels of the grouped (expert) products (a MoE model; empty otherwise)
        "experts": sorted({f.kernel for g in workload.grouped
                           for _, f in plan.product(g.name).by_rows}),
        "params": {"checkpoint_bytes": params.checkpoint_bytes,
                   "held_bytes": params.held_bytes,
                   "held_bytes_per_chip": params.held_bytes_per_chip},
        "kv": {"pages": kv_pages, "page_size": ec.page_size, "bytes": kv_total,
               "values_bytes": kv_values, "bytes_per_chip": kv_total // kv_shards},
        "programs": rows,
        "compiled": all(r["compiled"] for r in rows)}


def compile_report(model: str | None, dtype: str, topology: str, tp: int,
                   context: int, sizes: tuple[str, ...],
                   which: list[tuple[str, int]] | None = None) -> dict[str, Any]:
    """`doctor --target tpu --compile`'s report: the model `model` names (None: the
    embedded default model) in `dtype` ("auto": as a TPU engine resolves it) and the random
    shapes `sizes` in bfloat16; the programs `which` (None: every program)."""
    import jax

    from multiserve.bench.random_model import SIZES
    from multiserve.engine.base.dtype_choice import choose_dtype
    from multiserve.model.loading.hf import load_hf_config
    from multiserve.model.loading.loader import resolve_model_dir

    model_dir = resolve_model_dir(model)
    choice = choose_dtype(dtype, "tpu", None if model is None else model_dir, None, None)
    models = [compile_model(model or "the default model (SmolLM2-135M)",
                            load_hf_config(model_dir), choice.dtype, topology, tp,
                            context=context, which=which)]
    models += [compile_model(f"random {s} shape (bench/random_model.py {s!r})", SIZES[s],
                             "bfloat16", topology, tp, context=context, which=which)
               for s in sizes]
    return {"target": "tpu", "topology": topology, "tp": tp, "jax": jax.__version__,
            "host_platform": jax.devices()[0].platform, "models": models,
            "compiled": all(m["compiled"] for m in models)}


def _collective_totals(collectives: list[dict[str, Any]]
                       ) -> dict[tuple[str, str], tuple[int, int]]:
    """{(op, dtype): (executions, bytes)} of a program's collectives."""
    out: dict[tuple[str, str], tuple[int, int]] = {}
    for c in collectives:
        n, b = out.get((c["op"], c["dtype"]), (0, 0))
        out[(c["op"], c["dtype"])] = (n + c["times"], b + c["bytes"] * c["times"])
    return out


def _gb(b: float) -> str:
    return f"{b / GB:.2f} GB"


def print_compile_report(report: dict[str, Any]) -> None:
    print(f"target: tpu, {report['topology']}, TP {report['tp']}: compiled here by the TPU "
          f"compiler (libtpu), nothing runs (host: {report['host_platform']}, jax "
          f"{report['jax']})")
    for m in report["models"]:
        s, p, kv = m["shape"], m["params"], m["kv"]
        print(f"\n== {m['model']}, {m['dtype']} on {m['device_kind']} x{m['tp']}: "
              f"{s['layers']} layers, hidden {s['hidden']}, {s['heads']} heads / "
              f"{s['kv_heads']} KV of {s['head_dim']}, vocab {s['vocab']}; attention "
              f"{m['attention']}")
        print(f"params: checkpoint {_gb(p['checkpoint_bytes'])}, held "
              f"{_gb(p['held_bytes'])} ({p['held_bytes'] / p['checkpoint_bytes']:.2f}x), "
              f"{_gb(p['held_bytes_per_chip'])} per chip; KV pool {kv['pages']} pages of "
              f"{kv['page_size']}: {_gb(kv['bytes'])}"
              + (f" (values {_gb(kv['values_bytes'])})" if kv["values_bytes"] != kv["bytes"]
                 else "")
              + f", {_gb(kv['bytes_per_chip'])} per chip; "
              f"floors at context {m['context']}")
        if "gmm" in m.get("experts", ()):
            print("experts: the grouped matmul (megablox), held as per-layer stacks; the "
                  "compiler counts its kernel's bound (one expert matrix per possible row "
                  "tile: tiles + experts - 1 a call), the floor the routed experts only")
        for r in m["programs"]:
            what = (f"{r['kind'].upper()} {r['size']}"
                    + (" (scanned)" if r["scanned"] else ""))
            if not r["compiled"]:
                print(f"{what}: FAILED to compile: {r['error'].splitlines()[0][:600]}")
                continue
            h = r["hbm"]
            fits = {None: "", True: "", False: " DOES NOT FIT"}[h["fits"]]
            print(f"{what}: HBM args {_gb(h['arguments'])}, out {_gb(h['outputs'])}, temp "
                  f"{_gb(h['temporaries'])}, aliased {_gb(h['aliased'])}, peak "
                  f"{_gb(h['peak'])}{fits} | accessed "
                  f"{_gb(r['bytes_accessed'])}, {r['flops'] / 1e9:.1f} GFLOP | floor "
                  f"{_gb(r['floor'])}, ratio {r['ratio']}x | {r['pallas_calls']} kernel "
                  f"calls, {r['seconds']} s")
            print("    top: " + ", ".join(f"{o['op']} {_gb(o['bytes'])} x{o['count']}"
                                          for o in r["top_ops"][:6]))
            if r["collectives"]:
                print("    collectives: " + ", ".join(
                    f"{op} {dtype} x{n} ({b / 1e6:.2f} MB)"
                    for (op, dtype), (n, b) in _collective_totals(r["collectives"]).items()))
    print(f"\nCOMPILED: {report['compiled']}")


def doctor_compile(args: argparse.Namespace) -> int:
    """`doctor --target tpu --compile`; exit 1 if any program failed to compile. The host
    platform is the CPU unless JAX_PLATFORMS says otherwise: the TPU devices are
    compile-only, and on a TPU host the compile does not take its chips."""
    import os

    import jax

    from multiserve.doctor.steps import DEPRECATED_KINDS
    from multiserve.model.target_compile import NoTpuCompiler

    if not os.environ.get("JAX_PLATFORMS"):
        jax.config.update("jax_platforms", "cpu")
    which = None
    if args.programs:
        which = [(DEPRECATED_KINDS.get(kind, kind), int(size)) for kind, _, size in
                 (p.partition(":") for p in args.programs)]
    try:
        report = compile_report(args.model, args.dtype, args.topology, args.tp,
                                args.context, tuple(args.sizes), which)
    except NoTpuCompiler as e:
        print(f"doctor --compile: {e}")
        return 1
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print_compile_report(report)
    return 0 if report["compiled"] else 1
