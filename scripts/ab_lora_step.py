"""What LoRA adds to one decode step's forward: the decoder with the adapter buffers and
every token on an adapter, against the same decoder without LoRA, on one engine's
weights, plan and KV pool, in one process, rounds alternating in order.

    PYTHONPATH=. python scripts/ab_lora_step.py [--dtype bfloat16] [--tokens 1 64] [--separate]

The engine has 4 adapters of rank 16 on all seven target modules (the random ones of
multiserve/bench/lora_bench.py); at T tokens token t uses adapter 1 + t mod 4 (the
bench's round-robin). Each round times 10 forwards of each form (the KV pool donated and
threaded through); prints per T the median and best ms a forward of each form, the
median of the per-round differences (LoRA - base, ms) and the sha256 of the LoRA form's
hidden states (the same bits before and after a change to the kernel: compare them).
--separate adds a third form: the LoRA step traced with lora.FUSED_AT_ONE_TOKEN off (at
T=1 the delta in calls of its own after the products, as at T > 1), timed in the same
rounds, its hidden states' sha256 compared with the fused form's (the same bits).
AB_LORA_HLO=prefix writes each compiled program's optimized HLO to prefix-<form>-<T>.txt.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import time
from typing import Any

import jax
import numpy as np

import multiserve.bench.breakdown as B
from multiserve.bench.lora_bench import adapter_name, random_adapter_tensors
from multiserve.config import EngineConfig
from multiserve.engine.commands import Call
from multiserve.engine.engine import Engine
from multiserve.model.layers import lora as lora_layer
from multiserve.model.layers.forward_batch import ForwardBatch

ADAPTERS, RANK = 4, 16


def measure(core: Any, tokens: tuple[int, ...], rounds: int, separate: bool) -> str:
    """One line per T (the engine thread: its weights, plan and KV pool)."""
    runner = core.runner
    family, cfg = runner.family, runner.model_cfg
    kw = dict(page_size=core.page_size, attn_block_size=core.cfg.attention_block_size,
              plan=runner.plan)

    def fwd(params: Any, kv: Any, batch: ForwardBatch) -> Any:
        return family.forward_hidden(params, kv, batch, cfg, **kw)

    jitted = jax.jit(fwd, donate_argnums=(1,))
    lines: list[str] = []
    for t in tokens:
        shape = B.step_shape(core, [90] * t, 64)
        a = B.decode_arrays(shape, runner.page_table_rows(shape.tokens), runner.max_rows,
                            core.max_pages, core.page_size, runner.num_pages,
                            cfg.vocab_size)
        slots = np.zeros(shape.tokens, np.int32)
        slots[:t] = 1 + np.arange(t) % ADAPTERS
        base = ForwardBatch(input_ids=a.input_ids, positions=a.positions,
                            token_seq=a.token_seq, out_slots=a.out_slots,
                            page_table=a.page_table, seq_lens=a.seq_lens,
                            logit_rows=a.logit_rows, lora_slots=None)
        base = jax.tree.map(jax.numpy.asarray, base)
        lora = dataclasses.replace(base, lora_slots=jax.numpy.asarray(slots))
        with_lora = runner.compute_params
        without = {k: v for k, v in with_lora.items() if k != "lora"}
        forms = {"base": (without, base), "lora": (with_lora, lora)}
        if separate:  # the same LoRA step with the delta in calls of its own
            forms["lora-separate"] = (with_lora, lora)
        times: dict[str, list[float]] = {k: [] for k in forms}
        compiled: dict[str, Any] = {}
        for name, (p, b) in forms.items():  # compiled with the engine's XLA options
            lora_layer.FUSED_AT_ONE_TOKEN = name != "lora-separate"
            # its own jit: a traced program is cached per function, flag or no flag
            own = jitted if name != "lora-separate" else jax.jit(
                lambda p, kv, b: fwd(p, kv, b), donate_argnums=(1,))
            try:
                compiled[name] = own.lower(p, runner.kv, b).compile(
                    compiler_options=runner.step_programs.xla_options)
            finally:
                lora_layer.FUSED_AT_ONE_TOKEN = True
            h, runner.kv = compiled[name](p, runner.kv, b)
            jax.block_until_ready(h)
            if os.environ.get("AB_LORA_HLO"):  # the optimized program, for a look
                with open(f"{os.environ['AB_LORA_HLO']}-{name}-{t}.txt", "w") as f:
                    f.write(compiled[name].as_text())
        for i in range(rounds):
            for name in (list(forms) if i % 2 == 0 else list(forms)[::-1]):
                p, b = forms[name]
                t0 = time.perf_counter()
                for _ in range(10):
                    h, runner.kv = compiled[name](p, runner.kv, b)
                jax.block_until_ready(h)
                times[name].append((time.perf_counter() - t0) / 10 * 1e3)
        digests = {}
        for name in forms:
            if name != "base":
                h, runner.kv = compiled[name](*forms[name][:1], runner.kv, forms[name][1])
                digests[name] = hashlib.sha256(np.asarray(h).tobytes()).hexdigest()[:12]

        def diff(a: str, b: str) -> float:
            return float(np.median(np.array(times[a]) - np.array(times[b])))

        lines.append(f"T={shape.tokens}: " + " | ".join(
            f"{k}: median {np.median(v):.3f} best {min(v):.3f} ms" for k, v in times.items())
            + f" | lora - base median {diff('lora', 'base'):.3f} ms, ratio base/lora "
              f"{np.median(times['base']) / np.median(times['lora']):.3f} | LoRA "
              f"hidden sha256 {digests['lora']}")
        if separate:
            same = digests["lora"] == digests["lora-separate"]
            lines.append(f"  separate form: lora-separate - base median "
                         f"{diff('lora-separate', 'base'):.3f} ms, lora - lora-separate "
                         f"median {diff('lora', 'lora-separate'):.3f} ms | sha256 "
                         f"{digests['lora-separate']} ({'same' if same else 'DIFFERENT'} "
                         "bits)")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--separate", action="store_true",
                    help="also time the LoRA step with the delta in calls of its own "
                         "(lora.FUSED_AT_ONE_TOKEN off: differs at T=1) and compare bits")
    args = ap.parse_args()
    buckets = tuple(sorted(set(args.tokens)))
    engine = Engine(EngineConfig(dtype=args.dtype, show_progress=False,
                                 compile_in_background=False,
                                 precompile_token_paddings=buckets,
                                 precompile_bs_paddings=buckets,
                                 max_running_requests=max(buckets),
                                 chunked_prefill_size=max(buckets),
                                 max_loras_per_batch=ADAPTERS, max_lora_rank=RANK))
    try:
        for i in range(ADAPTERS):
            res = engine.load_lora_adapter(adapter_name(i), tensors=random_adapter_tensors(
                engine.model_config, RANK, 1000 + i), r=RANK, lora_alpha=float(RANK))
            assert res.ok, res.message
        print(engine.call(Call(lambda core: measure(core, buckets, args.rounds,
                                                    args.separate))).result())
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
