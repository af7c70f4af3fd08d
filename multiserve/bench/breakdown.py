"""Step-time breakdown of a bench run (issue 19): where the run's typical decode step goes.

The step measured is the run's typical decode step: n = min(num_prompts,
max_running_requests) decode rows, padded as the engine pads them (T = the token bucket
of its forward, R = the row bucket of its head and sampler: `Runner.bucket_for`), row i at
position len(prompt i) + output_len // 2 (so the mean context is the mean prompt length
plus half the output). Components, each timed alone:

- forward: the engine's own compiled T-token forward program (decoder, final norm) on
  that batch, plus the head: `llama.lm_head` at R rows (the plan's head formulation);
- products: every layer matrix at T rows through `primitives.dense` with the plan's
  formulations, and nothing else, plus the head (the same head figure as the forward's:
  it is one product, timed once);
- attention: `attention.paged_attention` for every layer with the plan's attention entry;
- sampler: `sampling.sampler.sample` on R rows (padded to its chunk) with the run's
  sampling (greedy, or temperature and per-request seeds);
- head program: the engine's own R-row program alone (head, in-flight ids, sampler): what
  it costs beyond head + sampler is glue inside it, the rest of the glue lies between
  the two programs;
- device step: the step as `Runner.run` launches it, on the step's arrays: its fused
  program where the engine has one for it (`fused_step`: T = R, one program), else the
  engine's own two programs (the T-token forward, then the R-row head + sampler program)
  back to back;
- wall step: the measured run's wall time / its decode steps;
and derived: other device work = forward - products - attention (norms, RoPE, KV writes,
gathers, the embedding), step glue = device step - forward - sampler (what the parts
timed alone miss: the two programs' boundaries, the in-flight token handling, the head's
rows gathered inside the R program; below zero where a fused step saves more than that), host = wall step - device step (the wall time of a
step not spent in its device programs: with overlap scheduling, host work hidden behind
the device does not appear). The run's wall includes its prefill, which a short run
spreads over few decode steps: the steady decode step (the run's ITL p50, the time between a
request's consecutive tokens) and the host time beyond the device step at that step
are reported beside it (`steady`), against the device step's best AND its median over the
rounds: on a machine whose memory bus is shared the median runs several percent above the
best, and the ITL p50 compares with the median (beyond it is the host's own time).

Invariants:
- Nothing is loaded twice: the breakdown runs on the engine thread (command `Call`)
  with the engine's params, KV pool, invariance plan and compiled forward program, after
  the measured runs and before shutdown, so it cannot disturb them.
- It runs only on an idle engine (no request running or waiting, every KV page free):
  the synthetic batch writes K/V into pages no request holds, and the forward's donated
  pool is handed back to the runner at once.
- Every program is compiled and run once before any is timed; then the programs run in
  turns (one round: each once, each ended by `block_until_ready`), so load from outside
  falls on all of them alike, and a figure is a program's best run over the rounds.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from multiserve.bench.ours import request_params
from multiserve.engine.commands import Call
from multiserve.engine.step_inputs.token_arrays import StepArrays, empty_step_arrays
from multiserve.engine.device.programs import ProgramKind
from multiserve.engine.step_inputs.sampling_zeros import sampler_rows
from multiserve.engine.step_inputs.program_inputs import sampling_inputs, step_inputs, step_tree
from multiserve.engine.step_inputs import sampling_batch as sampling_host
from multiserve.engine.sampling import sampler as sampling
from multiserve.engine.state_report import internal_state
from multiserve.model.layers.attention import paged_attention
from multiserve.model.layers.forward_batch import ForwardBatch
from multiserve.model.families.llama import layer_weights, lm_head, project_together
from multiserve.model.invariance.primitives import dense

MAX_ROUNDS = 50  # timed rounds (each program once per round)
MIN_ROUNDS = 5  # at least this many, even past the budget
BUDGET_S = 6.0  # stop starting rounds once the timed runs took this long in all


@dataclass(frozen=True)
class StepShape:
    """The decode step measured: `rows` real decode rows at `positions`, run at `tokens`
    (forward bucket T) and `logit_rows` (head / sampler bucket R); row b's prompt was
    `prompt_lens[b]` tokens (empty: the whole context counts as prompt)."""

    rows: int
    tokens: int
    logit_rows: int
    positions: tuple[int, ...]
    prompt_lens: tuple[int, ...] = ()


def step_shape(core: Any, prompt_lens: Sequence[int], output_len: int) -> StepShape:
    """The run's typical decode step on this engine (the engine thread)."""
    runner = core.runner
    n = min(len(prompt_lens), core.cfg.max_running_requests)
    t, r = runner.bucket_for(n, n)
    last = core.max_context - 1
    positions = tuple(min(int(p) + output_len // 2, last) for p in prompt_lens[:n])
    prompts = tuple(min(int(p), pos + 1) for p, pos in zip(prompt_lens[:n], positions, strict=True))
    return StepShape(rows=n, tokens=t, logit_rows=r, positions=positions, prompt_lens=prompts)


def page_lists(shape: StepShape, page_size: int, num_pages: int) -> list[list[int]]:
    """Each row's pages as the engine allocates them to rows admitted together: a prompt's
    pages consecutive (prefill, row after row), then, decode step by decode step, a fresh
    page for each row crossing a page boundary, so the rows' later pages interleave (the
    attention kernel reads them scattered, as in a run). Ids from 1 on, wrapping past the
    pool's last page (rows may share pages in a small pool: the cost is the same, the
    values junk)."""
    taken = 0

    def take() -> int:
        nonlocal taken
        taken += 1
        return 1 + (taken - 1) % (num_pages - 1)

    prompts = shape.prompt_lens or tuple(p + 1 for p in shape.positions)
    pages = [[take() for _ in range(-(-n // page_size))] for n in prompts]
    rows = list(zip(shape.positions, prompts, strict=True))
    for k in range(max(pos - n for pos, n in rows) + 1):
        for b, (pos, n) in enumerate(rows):
            if n + k <= pos and (n + k) % page_size == 0:
                pages[b].append(take())
    return pages


def decode_arrays(shape: StepShape, page_rows: int, max_rows: int, max_pages: int,
                  page_size: int, num_pages: int, vocab: int) -> StepArrays:
    """Host arrays of a decode step as the engine builds them (step_inputs/token_arrays.py):
    token b is row b's one new token, its pages `page_lists`; padding tokens write into page 0
    and read sequence row 0."""
    a = empty_step_arrays(shape.tokens, page_rows, max_rows, max_pages)
    rng = np.random.default_rng(0)
    for b, (pos, row_pages) in enumerate(zip(shape.positions,
                                             page_lists(shape, page_size, num_pages),
                                             strict=True)):
        count = pos // page_size + 1
        assert len(row_pages) == count, (b, pos, len(row_pages))
        pages = np.asarray(row_pages)
        a.input_ids[b] = rng.integers(0, vocab)
        a.positions[b] = pos
        a.token_seq[b] = b
        a.out_slots[b] = pages[-1] * page_size + pos % page_size
        a.page_table[b, :count] = pages
        a.seq_lens[b] = pos + 1
        a.logit_rows[b] = b
    return a


def best_ms(runs: dict[str, Callable[[], Any]], max_rounds: int = MAX_ROUNDS,
            min_rounds: int = MIN_ROUNDS, budget_s: float = BUDGET_S
            ) -> tuple[dict[str, float], int, dict[str, float]]:
    """(best wall time in ms of each `runs[name]()`, rounds timed, median in ms of each);
    each run ended by block_until_ready: one untimed run of each (compile, first-execution
    costs), then rounds of one run of each, until `max_rounds`, or `budget_s` spent after
    at least `min_rounds`."""
    for run in runs.values():
        jax.block_until_ready(run())
    took: dict[str, list[float]] = {name: [] for name in runs}
    spent = 0.0
    rounds = 0
    while rounds < max_rounds and (rounds < min_rounds or spent <= budget_s):
        for name, run in runs.items():
            t0 = time.perf_counter()
            jax.block_until_ready(run())
            took[name].append(time.perf_counter() - t0)
            spent += took[name][-1]
        rounds += 1
    return ({name: 1000.0 * min(t, default=math.inf) for name, t in took.items()}, rounds,
            {name: 1000.0 * float(np.median(t)) if t else math.inf
             for name, t in took.items()})


def _layer_products_fn(plan: Any, cfg: Any) -> Callable[..., Any]:
    """Every layer matrix at x's row count, chained the way the decoder chains them (q
    feeds wo, gate * up feeds w_down), each in the layout the plan's kernel reads (the
    native kernel's stacked panels indexed by layer, as the decoder does). Every product's
    whole output reaches a result (no slice the compiler could push into a product, no
    dead code); the layer input moves only by a small residual (no growth over layers);
    only elementwise glue runs beside the products."""

    def run(layers: tuple[dict[str, jax.Array], ...], stacked: dict[str, jax.Array],
            x: jax.Array) -> tuple[jax.Array, jax.Array]:
        def proj(h: jax.Array, w: dict[str, Any], name: str) -> jax.Array:
            panels = w[f"{name}_p"]
            return dense(h, w[name], w[f"{name}_t"], plan.product(name), w_p=panels,
                         layer=None if panels is None else w["layer"])

        h = x
        kv = jnp.zeros((), x.dtype)
        for index, layer in enumerate(layers):
            w: dict[str, Any] = {**layer_weights(layer, x.shape[0], plan, cfg, stacked),
                                 "layer": index}

            def by_name(h_: jax.Array, name: str, w: dict[str, Any] = w) -> jax.Array:
                return proj(h_, w, name)

            # the groups the decoder computes as one product, computed as it does
            q, k, v = project_together(h, w, index, plan, by_name, "wqkv")
            gate, up = project_together(h, w, index, plan, by_name, "w_gateup")
            out = proj(q, w, "wo") + proj(gate * up, w, "w_down")
            kv = kv + k + v
            h = x + 1e-3 * out
        return kv, h

    return jax.jit(run)


def _attention_fn(plan: Any, num_layers: int, page_size: int, block_size: int
                  ) -> Callable[..., Any]:
    """paged_attention for every layer (unrolled over the layers, as the decoder of a
    step of up to the family's `unroll_max_tokens` tokens is), the outputs summed so none
    is dead code."""

    def run(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, batch: ForwardBatch
            ) -> jax.Array:
        total = jnp.zeros(q.shape, jnp.float32)
        for layer in range(num_layers):
            out = paged_attention(q, k_pool, v_pool, layer, batch, page_size=page_size,
                                  block_size=block_size, plan=plan.attention)
            total = total + out.astype(jnp.float32)
        return total

    return jax.jit(run)


def _sampler_batch(runner: Any, shape: StepShape, output_len: int, temperature: float,
                   seed: int) -> Any:
    """The host SamplingBatch of the step: row b samples like bench request b."""
    specs = [sampling_host.RowSpec(params=request_params(output_len, temperature, seed, b),
                                   seed=seed + b, sample_index=0, position=pos,
                                   output_ids=(), prompt_ids=())
             for b, pos in enumerate(shape.positions)]
    return runner.sampling_batch(specs, shape.logit_rows)


def measure(core: Any, prompt_lens: Sequence[int], output_len: int, temperature: float,
            seed: int) -> dict[str, Any]:
    """Device figures (ms) of the run's typical decode step; runs on the engine thread."""
    state = internal_state(core)
    if (state["running_batch_size"] or state["waiting_queue_size"]
            or state["available_kv_tokens"] != state["initial_available_kv_tokens"]):
        raise RuntimeError("bench breakdown: the engine is not idle")
    runner = core.runner
    mcfg, plan, dtype = runner.model_cfg, runner.plan, runner.dtype
    if mcfg.num_experts:
        raise NotImplementedError("the step breakdown covers the dense families only "
                                  f"(this model is {mcfg.architecture})")
    shape = step_shape(core, prompt_lens, output_len)
    program = runner.programs.get(ProgramKind.FORWARD, shape.tokens)
    if program is None:
        raise RuntimeError(f"bench breakdown: no compiled forward for T={shape.tokens}")
    arrays = decode_arrays(shape, runner.page_table_rows(shape.tokens), runner.max_rows,
                           core.max_pages, core.page_size, runner.num_pages, mcfg.vocab_size)
    device = jax.device_put(step_tree(arrays), runner.replicated)
    packed_step = step_inputs(arrays)  # what the forward program reads
    batch = ForwardBatch(**{k: v for k, v in device.items() if k != "from_prev"})
    params = runner.compute_params
    rng = np.random.default_rng(1)

    def put(shape_: tuple[int, ...], dt: Any = dtype) -> jax.Array:
        return jax.device_put(rng.standard_normal(shape_).astype(dt), runner.replicated)

    prev_ids = jax.device_put(np.zeros(runner.max_rows, np.int32), runner.replicated)

    def decoder() -> Any:  # the engine's own program; the donated pool goes straight back
        hidden, tok, prev, runner.kv = program(params, runner.kv, prev_ids, packed_step)
        return hidden, tok, prev, runner.kv

    hidden = put((shape.logit_rows, mcfg.hidden_size))
    head = jax.jit(lambda w, wt, wp, h: lm_head({"head_w": w, "head_wt": wt, "head_wp": wp},
                                                 h, plan))
    layer_products = _layer_products_fn(plan, mcfg)
    attention = _attention_fn(plan, mcfg.num_layers, core.page_size,
                              runner.cfg.attention_block_size)
    x = put((shape.tokens, mcfg.hidden_size))
    q = put((shape.tokens, mcfg.num_heads, mcfg.head_dim))
    logits = put((sampler_rows(shape.logit_rows), mcfg.vocab_size), np.float32)
    sb_host = _sampler_batch(runner, shape, output_len, temperature, seed)
    sb = jax.device_put(sb_host, runner.replicated)  # for the sampler timed alone
    sb_inputs = sampling_inputs(sb_host)  # what the head program reads
    sample = jax.jit(sampling.sample)
    head_program = runner.programs.get(ProgramKind.HEAD, shape.logit_rows)
    if head_program is None:
        raise RuntimeError(f"bench breakdown: no compiled head for R={shape.logit_rows}")

    # the R program's own inputs, made once by the forward (it reads, never donates them)
    hidden_t, tok_t, prev_t, runner.kv = program(params, runner.kv, prev_ids, packed_step)

    # the step as Runner.run runs it: its fused program where it has one, else the two
    fused = runner.step_programs.fused(shape.tokens, shape.logit_rows)

    def step() -> Any:
        if fused is not None:
            _, out, runner.kv = fused(params, runner.kv, prev_ids, packed_step, *sb_inputs)
            return out
        hidden_, tok, prev, runner.kv = program(params, runner.kv, prev_ids, packed_step)
        return head_program(params, hidden_, tok, prev, *sb_inputs)
    ms, rounds, median = best_ms({
        "decoder": decoder,
        "head": lambda: head(params["head_w"], params["head_wt"], params.get("head_wp"),
                             hidden),
        "layer_products": lambda: layer_products(params["layers"], params["stacked_layers"],
                                                 x),
        "attention": lambda: attention(q, runner.kv.k, runner.kv.v, batch),
        "sampler": lambda: sample(logits, sb),
        "step": step,
        "head_program": lambda: head_program(params, hidden_t, tok_t, prev_t, *sb_inputs),
    })
    return {"rows": shape.rows, "tokens": shape.tokens, "logit_rows": shape.logit_rows,
            "context_mean": float(np.mean(shape.positions)) + 1.0,
            "attention_kernel": plan.attention.kernel, "num_layers": mcfg.num_layers,
            "fused_step": fused is not None, "rounds": rounds, "device_ms": ms,
            "device_step_median_ms": median["step"]}


def summarize(device: dict[str, Any], wall_s: float, decode_steps: int,
              itl_p50_s: float = math.nan) -> dict[str, Any]:
    """The JSON "breakdown": components in ms and as shares of the wall step, and the
    steady decode step (ITL p50) with the host time beyond the device step there.
    `parts_within_forward` is False when the products and the attention, each timed
    alone, add up to more than the forward that contains them: the host's load moved
    between the timed runs, and the derived "other device work" is not to be trusted."""
    d = device["device_ms"]
    forward = d["decoder"] + d["head"]
    products = d["layer_products"] + d["head"]
    wall_step = 1000.0 * wall_s / decode_steps if decode_steps else math.nan
    ms = {"forward": forward, "products": products, "attention": d["attention"],
          "other_device": forward - products - d["attention"],
          "sampler": d["sampler"], "step_glue": d["step"] - forward - d["sampler"],
          "device_step": d["step"], "host": wall_step - d["step"], "wall_step": wall_step}
    share = {k: v / wall_step if wall_step and not math.isnan(wall_step) else None
             for k, v in ms.items()}
    out = {k: v for k, v in device.items() if k not in ("device_ms", "device_step_median_ms")}
    itl = 1000.0 * itl_p50_s
    median = device.get("device_step_median_ms", math.nan)
    out.update({"ms": ms, "share_of_wall_step": share, "decode_steps": decode_steps,
                "parts_ms": {"decoder": d["decoder"], "head": d["head"],
                             "layer_products": d["layer_products"],
                             "head_program": d["head_program"]},
                "parts_within_forward": products + d["attention"] <= forward,
                "steady": {"decode_step_ms": itl, "host_ms": itl - d["step"],
                           "device_step_median_ms": median,
                           "host_beyond_median_ms": itl - median}})
    return out


def step_breakdown(engine: Any, prompts: Sequence[Sequence[int]], output_len: int,
                   run: dict[str, Any], temperature: float = 0.0, seed: int = 0
                   ) -> dict[str, Any]:
    """The breakdown of `run` (a run_once result on `engine`, with these prompts and
    sampling): measured on the engine thread, then summarized."""
    t0 = time.perf_counter()
    lens = [len(p) for p in prompts]
    device = engine.call(Call(lambda core: measure(core, lens, output_len, temperature,
                                                    seed))).result()
    out = summarize(device, float(run["wall_s"]), int(run["decode_steps"]),
                    float(run["itl_p50_s"]))
    out["seconds"] = time.perf_counter() - t0
    return out
