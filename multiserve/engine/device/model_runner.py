"""Runner: the jitted, bucketed forward + sample step of one engine, on its devices.

Owns the device state of one engine: sharded params (and their compute form, the layouts
the invariance plan's kernels read), the model's family (model/families: the runner talks
only to that interface: compute params, forward to hidden states, head), the KV pool
(donated to every step, updated in place), and the device buffer of the last step's
sampled ids.

A step is a forward and a head, so that shapes come from two independent bucket lists:
- `forward` over T tokens (T in `precompile_token_paddings`): the decoder; it returns the
  final-normed hidden states of the logits rows in a fixed [max_rows, D] buffer;
- the head over R logits rows (R in `precompile_bs_paddings`, `HeadProgram`): lm_head on
  the first R rows, float32 logits padded to R rounded up to the sampler's chunk
  (sampling.ROW_CHUNK), then the sampler program of that row count, which depends on
  nothing else but the vocabulary and max_rows (shared by the R buckets of one chunk
  count, and by engines of one vocabulary through the compilation caches).
So |T| + |R| buckets are compiled, not |T| x |R|, and a lone decode runs at T = R = 1.
- a fused step ("S", b for b in `cfg.fused_step_sizes`): the forward, head and sampler of
  a b-token, b-row step in ONE program (`_step_impl`), which a decode step of that size
  runs instead of the two: one execution instead of three (logits, then sampler) saves
  each step's hand-offs between programs (docs/performance.md §20). It is the same
  computation with the same intermediate shardings, and its prime checks it against the
  two programs bit for bit (`_prime`); a program that differs is rejected and the step
  runs the two.
Every row's numerics are independent of T and R (row_invariant.py, attention.py, and the
sampler's fixed-size row chunks).

Invariants:
- Steps call compiled executables (programs.py), never `jax.jit` dispatch: a step cannot
  trace or compile. `warmup()` compiles the covering buckets, then the rest (optionally in
  the background while serving); `bucket_for` picks only compiled buckets, so
  `cache_miss_count` (programs compiled on the step path) stays 0 after warm-up.
- A program's small host inputs travel as ONE packed int32 array (packed_inputs.py: the
  step arrays of a T program, the SamplingBatch fields of an R program except its two
  [R, V] penalty arrays and its [R, V/32] token mask, which are passed as device arrays); each program is lowered
  with the static layout of its bucket's inputs (`_abstract_inputs`; on demand, of the
  step's own).
- `run()` never waits for the device: it returns device arrays. The next step reads
  the previous step's sampled ids from `self._prev_ids` on device (overlap scheduling:
  no host round trip between consecutive decode steps).
- The jitted functions are created per Runner (closures over this engine's config and
  shardings); nothing device-resident is cached at module level.
- `params` is the canonical pytree (what weight updates and memory release read and
  replace); assigning it re-derives the compute params, so the two never disagree.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from multiserve.config import EngineConfig, ModelConfig
from multiserve.engine.device.batch_arrays import StepArrays, empty_step_arrays
from multiserve.engine.device import huge_pages
from multiserve.engine.device.packed_inputs import Layout, layout_of, pack, unpack
from multiserve.engine.device.program_share import SHARE
from multiserve.engine.device.programs import Plan, ProgramSet, plan, smallest_fit
from multiserve.engine.dtype_choice import DtypeChoice
from multiserve.engine.sampling import host as sampling_host
from multiserve.engine.sampling import sampler as sampling
from multiserve.model.invariance.calibration import calibrate
from multiserve.model.invariance.workload import workload_for
from multiserve.model.families import family_for
from multiserve.model.layers.forward_batch import ForwardBatch
from multiserve.model.invariance.plan import Calibration, InvariancePlan
from multiserve.model.invariance.xla_options import step_options
from multiserve.model.layers.kv_pool import KVPool, make_kv_pool
from multiserve.model.sharding import kv_pool_sharding, make_mesh, shard_params
from multiserve.types import MAX_TOP_LOGPROBS, SamplingParams

ARRAY_FIELDS = ("input_ids", "from_prev", "positions", "token_seq", "out_slots", "page_table",
                "seq_lens", "logit_rows")


def cast_params(params: Any, dtype: Any) -> Any:
    """Host (numpy) params cast to the engine's compute dtype (norms included)."""
    return jax.tree.map(lambda a: np.asarray(a).astype(np.dtype(dtype), copy=False), params)


def sampler_rows(num_rows: int) -> int:
    """Rows the sampler runs for `num_rows` logits rows: a multiple of its chunk."""
    return -(-num_rows // sampling.ROW_CHUNK) * sampling.ROW_CHUNK


@dataclass
class StepOutput:
    """Device arrays of one launched step (host reads them later)."""

    next_ids: jax.Array  # [max_rows] int32 (rows >= R are junk)
    sample: Any  # sampling.SampleOutput (device)
    num_rows: int
    wants_logprobs: bool


class Runner:
    def __init__(self, cfg: EngineConfig, model_cfg: ModelConfig, params_host: Any,
                 devices: Sequence[jax.Device], num_pages: int, dtype: Any,
                 dtype_choice: DtypeChoice | None = None) -> None:
        self.cfg = cfg
        self.model_cfg = model_cfg
        # the model interface (model/families): the runner calls nothing family-specific
        self.family = family_for(model_cfg)
        self.dtype = dtype
        # get_internal_state()["dtype_choice"]: what was asked, what runs, why
        self.dtype_choice = dtype_choice or DtypeChoice(str(jnp.dtype(dtype)),
                                                        str(jnp.dtype(dtype)), "given")
        self.devices = list(devices)
        self.mesh = make_mesh(self.devices)
        self.replicated = NamedSharding(self.mesh, P())
        # the XLA options of every program this runner compiles (model/invariance/xla_options.py)
        self.xla_options = step_options(self.devices[0].platform, str(jnp.dtype(dtype)))
        self.num_pages = num_pages
        self.max_rows = max(cfg.precompile_bs_paddings)
        self.calibration = self._calibrate()
        self.plan: InvariancePlan = self.calibration.plan
        # get_internal_state()["determinism"]: made once (immutable, read by any thread)
        self.determinism: dict[str, Any] = self.calibration.summary()
        self._compute: Any = None
        # the weights' last huge-page advice, written by its thread when done
        # (device/huge_pages.py)
        self.huge_page_advice: dict[str, huge_pages.HugePageAdvice] = {}
        self.huge_pages_thread: threading.Thread | None = None
        self.params = shard_params(cast_params(params_host, dtype), model_cfg, self.mesh,
                                   cfg.moe_sharding)
        self._kv_sharding = kv_pool_sharding(model_cfg, self.mesh)
        self.kv: KVPool | None = make_kv_pool(model_cfg, num_pages, cfg.page_size, dtype,
                                              sharding=self._kv_sharding)
        self._prev_ids = jax.device_put(np.zeros(self.max_rows, np.int32), self.replicated)
        self._zero_cache: dict[int, Any] = {}
        self._mask_zero_cache: dict[int, Any] = {}
        self.warmup_seconds: float | None = None  # warm-up start -> serving
        self.programs = ProgramSet.on_demand()  # replaced by warmup()
        self._warm_started = False
        self._step_compiles = 0
        self.fused_steps = 0  # steps run as one fused program (get_internal_state)
        self._prime_pages = 1
        # warm-up compiles in parallel; an engine alone on the host uses every core
        self.compile_threads = min(4, os.cpu_count() or 1)
        # explicit output shardings: warm-up lowers the heads from abstract inputs that
        # must match what a forward really returns
        self._forward_fn = jax.jit(
            self._forward_impl, donate_argnums=(1,),
            static_argnames=("layout",),
            out_shardings=(self.replicated, self.replicated, self.replicated,
                           KVPool(k=self._kv_sharding, v=self._kv_sharding)))
        # replicated logits: the sampler program runs whole on every device (a tensor-
        # parallel lm_head's vocabulary-split logits are gathered here)
        self._logits_fn = jax.jit(self._logits_impl, static_argnames=("num_rows",),
                                  out_shardings=(self.replicated,) * 3)
        self._sample_fn = jax.jit(_sample_impl, static_argnames=("layout", "max_rows"))
        self._step_fn = jax.jit(
            self._step_impl, donate_argnums=(1,),
            static_argnames=("layout", "sample_layout", "num_rows"),
            out_shardings=(self.replicated, self.replicated,
                           KVPool(k=self._kv_sharding, v=self._kv_sharding)))
        # sampler programs by sampler rows: the R buckets of one chunk count share one
        self._samplers: dict[int, Any] = {}
        self._sampler_locks: dict[int, threading.Lock] = {}
        self._samplers_lock = threading.Lock()

    # ---- params ---------------------------------------------------------------------
    @property
    def params(self) -> Any:
        """The canonical params pytree on the device (None while released)."""
        return self._params

    @params.setter
    def params(self, value: Any) -> None:
        self._params = value
        self._compute = None  # drop the old transposed copies before making new ones
        if value is not None:
            self._compute = self.family.compute_params(value, self.model_cfg, self.plan,
                                                       self.cfg.precompile_token_paddings)
            self.huge_pages_thread = huge_pages.in_background(
                self._compute, partial(self.huge_page_advice.__setitem__, "weights"))

    @property
    def compute_params(self) -> Any:
        """The params the step runs on: `params` plus their transposed copies (None while
        released). Every device array holding weights is a leaf of this pytree."""
        return self._compute

    def _calibrate(self) -> Calibration:
        """This engine's invariance plan: pinned by the config, else measured on its first
        device's backend for exactly its shapes and buckets (model/invariance/calibration.py; cached,
        so a second start, or a second engine of the same kind, probes nothing)."""
        cfg = self.cfg
        if cfg.invariance_plan is not None:
            return Calibration(cfg.invariance_plan, {"pinned": True}, "pinned", 0.0, False)
        workload = workload_for(self.model_cfg, cfg.precompile_token_paddings,
                                cfg.precompile_bs_paddings, self.max_rows, cfg.page_size,
                                cfg.attention_block_size, self.dtype, tp=len(self.devices),
                                moe_sharding=cfg.moe_sharding)
        return calibrate(workload, self.devices[0])

    # ---- the traced step -----------------------------------------------------------
    def _forward_impl(self, params: Any, kv: KVPool, prev_ids: jax.Array, packed: jax.Array,
                      *, layout: Layout) -> tuple[jax.Array, jax.Array, jax.Array, KVPool]:
        arrays = unpack(packed, layout)
        from_prev = arrays["from_prev"]
        ids = jnp.where(from_prev >= 0, prev_ids[jnp.maximum(from_prev, 0)],
                        arrays["input_ids"])
        fb = ForwardBatch(input_ids=ids, positions=arrays["positions"],
                          token_seq=arrays["token_seq"], out_slots=arrays["out_slots"],
                          page_table=arrays["page_table"], seq_lens=arrays["seq_lens"],
                          logit_rows=arrays["logit_rows"])
        hidden, kv = self.family.forward_hidden(params, kv, fb, self.model_cfg,
                                                page_size=self.cfg.page_size,
                                                attn_block_size=self.cfg.attention_block_size,
                                                plan=self.plan)
        rows = arrays["logit_rows"]
        return hidden, ids[rows], from_prev[rows] >= 0, kv

    def _logits_impl(self, params: Any, hidden: jax.Array, row_tok: jax.Array,
                     row_prev: jax.Array, *, num_rows: int
                     ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The head's first program: float32 logits of the first `num_rows` rows, padded
        with zero rows to the sampler's rows (`sampler_rows`), and the rows' unread-token
        inputs padded alike (padding rows: greedy, mask False)."""
        logits = self.family.lm_head(params, hidden[:num_rows], self.plan)
        rows = sampler_rows(num_rows)
        if rows > num_rows:
            logits = jnp.pad(logits, ((0, rows - num_rows), (0, 0)))
        tok, prev = row_tok[:rows], row_prev[:rows]
        if tok.shape[0] < rows:  # max_rows below the sampler's row chunk
            tok = jnp.pad(tok, (0, rows - tok.shape[0]))
            prev = jnp.pad(prev, (0, rows - prev.shape[0]))
        return logits.astype(jnp.float32), tok, prev

    def _step_impl(self, params: Any, kv: KVPool, prev_ids: jax.Array, packed: jax.Array,
                   packed_sb: jax.Array, output_counts: jax.Array, prompt_mask: jax.Array,
                   token_mask: jax.Array, *, layout: Layout, sample_layout: Layout,
                   num_rows: int) -> tuple[jax.Array, Any, KVPool]:
        """A fused step: `_forward_impl`, `_logits_impl` and `_sample_impl` in one program,
        each boundary's arrays constrained to the sharding the two programs pass them in
        (so a tensor-parallel head's logits are gathered before the sampler, as there)."""
        def replicated(*xs: jax.Array) -> tuple[jax.Array, ...]:
            return tuple(jax.lax.with_sharding_constraint(x, self.replicated) for x in xs)

        hidden, row_tok, row_prev, kv = self._forward_impl(params, kv, prev_ids, packed,
                                                           layout=layout)
        logits, tok, prev = replicated(*self._logits_impl(
            params, *replicated(hidden, row_tok, row_prev), num_rows=num_rows))
        next_ids, out = _sample_impl(logits, tok, prev, packed_sb, output_counts,
                                     prompt_mask, token_mask, layout=sample_layout,
                                     max_rows=self.max_rows)
        return next_ids, out, kv

    # ---- buckets / warm-up ---------------------------------------------------------
    def buckets(self) -> list[tuple[str, int]]:
        """Every step program: ("T", tokens) forwards, ("R", rows) heads and ("S", b)
        fused decode steps."""
        return ([("T", t) for t in self.cfg.precompile_token_paddings]
                + [("R", r) for r in self.cfg.precompile_bs_paddings]
                + [("S", b) for b in self.cfg.fused_step_sizes])

    def bucket_for(self, num_tokens: int, num_rows: int) -> tuple[int, int]:
        """The smallest compiled (T, R) buckets holding the step (all configured buckets
        when warm-up is off: those compile on first use)."""
        warm = self._warm_started
        t = smallest_fit(self.programs.ready("T") if warm
                         else self.cfg.precompile_token_paddings, num_tokens)
        r = smallest_fit(self.programs.ready("R") if warm
                         else self.cfg.precompile_bs_paddings, num_rows)
        if t is None or r is None:
            raise ValueError(f"no bucket for {num_tokens} tokens / {num_rows} rows")
        return t, r

    def page_table_rows(self, num_tokens: int) -> int:
        """Sequence rows of a T-token step: every row has a token, and at most max_rows."""
        return min(num_tokens, self.max_rows)

    def warmup_plan(self, background: bool) -> Plan:
        """Which programs `warmup` compiles before serving, and which after (programs.plan).
        The covering set takes the scanned token buckets too when some are unrolled (those
        compile several times slower and go last); when every size scans (native
        products), all compile alike and the largest token and row buckets cover."""
        tokens = self.cfg.precompile_token_paddings
        all_scan = all(self.family.scans(self.plan, t) for t in tokens)
        return plan(tokens, self.cfg.precompile_bs_paddings,
                    max(tokens) if all_scan else self.family.unroll_max_tokens, background,
                    self.cfg.fused_step_sizes)

    def _abstract_inputs(self, max_pages: int
                         ) -> dict[tuple[str, int], tuple[tuple[Any, ...], Any]]:
        """The arguments of every program as abstract shapes (shape, dtype, sharding), and
        the layout of its packed input (that of the bucket's padding inputs: every step of
        the bucket has their structure, shapes and dtypes), captured now so that compiling
        later never reads live arrays (the engine thread donates the KV pool and replaces
        params)."""
        def spec(tree: Any) -> Any:
            return _abstract(tree, self.replicated)

        params, kv, prev = spec(self._compute), spec(self.kv), spec(self._prev_ids)
        hidden = jax.ShapeDtypeStruct((self.max_rows, self.model_cfg.hidden_size), self.dtype,
                                      sharding=self.replicated)
        row_ids = jax.ShapeDtypeStruct((self.max_rows,), jnp.int32, sharding=self.replicated)
        row_prev = jax.ShapeDtypeStruct((self.max_rows,), jnp.bool_, sharding=self.replicated)
        out: dict[tuple[str, int], tuple[tuple[Any, ...], Layout]] = {}
        for kind, size in self.buckets():
            if kind == "T":
                arrays = empty_step_arrays(size, self.page_table_rows(size), self.max_rows,
                                           max_pages)
                out[(kind, size)] = ((params, kv, prev, spec(self.step_inputs(arrays))),
                                     layout_of(step_tree(arrays)))
            elif kind == "R":
                sb_host = self.sampling_batch([], size)
                sb = spec(self.sampling_inputs(sb_host))
                out[(kind, size)] = ((params, hidden, row_ids, row_prev, *sb),
                                     layout_of(_small_sampling_fields(sb_host)))
        for size in self.cfg.fused_step_sizes:  # a forward's inputs, then a head's sampling
            (t_in, t_layout), (r_in, r_layout) = out[("T", size)], out[("R", size)]
            out[("S", size)] = ((*t_in, *r_in[4:]), (t_layout, r_layout))
        return out

    def _compile(self, inputs: tuple[Any, ...], layout: Any, kind: str, size: int) -> Any:
        """Lower and compile one program (any thread). The one place programs are made:
        compiled here, or loaded from another engine's compile of the same program
        (program_share.py: a fleet compiles each program once, not once per engine)."""
        devices = list(self.mesh.devices.flat)
        if kind == "T":
            return SHARE.compile(self._forward_fn.lower(*inputs, layout=layout), devices,
                                 self.xla_options)
        if kind == "S":
            t_layout, r_layout = layout
            return SHARE.compile(self._step_fn.lower(*inputs, layout=t_layout,
                                                     sample_layout=r_layout, num_rows=size),
                                 devices, self.xla_options)
        params, hidden, row_tok, row_prev, *sb = inputs
        logits = SHARE.compile(self._logits_fn.lower(params, hidden, row_tok, row_prev,
                                                     num_rows=size), devices, self.xla_options)
        return HeadProgram(logits, self._sampler(sampler_rows(size), sb, layout, devices))

    def _sampler(self, rows: int, sb: list[Any], layout: Layout, devices: list[Any]) -> Any:
        """The sampler program over `rows` rows (compiled once per engine and row count,
        any thread; `sb`: the abstract sampling inputs, `layout` their packed layout). It
        depends only on (rows, vocabulary, max_rows) and the XLA options (`xla_options`:
        the same on a CPU for every dtype): engines of one vocabulary share it through the
        compilation caches, whatever their model."""
        with self._samplers_lock:  # one lock per row count: other counts compile meanwhile
            lock = self._sampler_locks.setdefault(rows, threading.Lock())
        with lock:
            program = self._samplers.get(rows)
            if program is None:
                def spec(shape: tuple[int, ...], dt: Any) -> jax.ShapeDtypeStruct:
                    return jax.ShapeDtypeStruct(shape, dt, sharding=self.replicated)

                lowered = self._sample_fn.lower(
                    spec((rows, self.model_cfg.vocab_size), jnp.float32),
                    spec((rows,), jnp.int32), spec((rows,), jnp.bool_), *sb, layout=layout,
                    max_rows=self.max_rows)
                program = self._samplers[rows] = SHARE.compile(lowered, devices,
                                                               self.xla_options)
        return program

    def warmup(self, max_pages: int, progress: Any = None, background: bool = False,
               on_complete: Any = None, on_first: Any = None) -> None:
        """Compile and prime the step programs (programs.py): the covering set first,
        blocking, with `compile_threads` threads; then (`background`) the rest on a thread
        while the engine serves — the engine primes those (`ProgramSet.set_primer`).
        `progress(kind, size)` is called as each program is compiled; `on_first()` once
        the covering set is ready, `on_complete()` once every program is."""
        inputs = self._abstract_inputs(max_pages)
        order = self.warmup_plan(background)
        self._warm_started = True
        self._prime_pages = max_pages
        self.programs = ProgramSet(
            lambda kind, size: self._compile(*inputs[(kind, size)], kind, size), self._prime)
        self.programs.compile_first(order.first, self.compile_threads, progress)
        if on_first is not None:
            on_first()
        self.programs.compile_rest(order.rest, self.compile_threads, progress, on_complete)

    def _prime(self, kind: str, size: int, program: Any) -> bool | None:
        """Run a compiled program once on padding inputs (the engine's owner thread): its
        first execution's one-off costs are paid here, not by a request, and a broken
        program fails here. Padding tokens write K/V only into the garbage page 0; the
        previous step's ids (`_prev_ids`) are read, never replaced, so a step in flight is
        unaffected. Skipped while memory is released (no params / KV to run on).
        A fused step is also checked (`_fused_step_agrees`): False rejects it; while memory
        is released its check waits (None) for `prime_deferred`.
        """
        if not self._resident:
            return None if kind == "S" else True
        if kind == "S":
            return self._fused_step_agrees(size, program)
        if kind == "T":
            arrays = empty_step_arrays(size, self.page_table_rows(size), self.max_rows,
                                       self._prime_pages)
            hidden, _, _, self.kv = program(self._compute, self.kv, self._prev_ids,
                                            self.step_inputs(arrays))
            jax.block_until_ready(hidden)
            return True
        hidden = jnp.zeros((self.max_rows, self.model_cfg.hidden_size), self.dtype,
                           device=self.replicated)
        rows = jnp.zeros((self.max_rows,), jnp.int32, device=self.replicated)
        sb = self.sampling_inputs(self.sampling_batch([], size))
        next_ids, _ = program(self._compute, hidden, rows, rows > 0, *sb)
        jax.block_until_ready(next_ids)
        return True

    def prime_deferred(self) -> None:
        """Memory is resident again: prime (and check) the programs that arrived while it
        was released. Between steps, on the engine thread."""
        if self._resident:
            self.programs.prime_deferred()

    @property
    def _resident(self) -> bool:
        """Weights, KV pool and step buffers are on the device (memory not released)."""
        return self._compute is not None and self.kv is not None and self._prev_ids is not None

    def _fused_step_agrees(self, size: int, program: Any) -> bool:
        """Run fused step `program` and the forward + head of its size (`programs.needs`:
        compiled before it is primed) on one step, and say whether every output (sampled
        ids, logprobs, ...) is bitwise the same. The step: `size` tokens of one id at
        position 0, each its own sequence of one token (the same K/V into the garbage
        page 0's slot 0, read back by its attention), every row a logits row, sampled as
        `_check_rows` says (seeded sampling with filters, penalties and a token mask;
        greedy; logprobs and top logprobs): a real forward, head and every sampler path."""
        arrays = empty_step_arrays(size, self.page_table_rows(size), self.max_rows,
                                   self._prime_pages)
        arrays.input_ids[:] = min(1, self.model_cfg.vocab_size - 1)
        arrays.token_seq[:] = np.arange(size) % arrays.seq_lens.shape[0]
        arrays.seq_lens[:] = 1
        arrays.logit_rows[:size] = np.arange(size)
        step = self.step_inputs(arrays)
        rows = _check_rows(size, self.model_cfg.vocab_size)
        sb = self.sampling_inputs(self.sampling_batch(rows, size))
        hidden, row_tok, row_prev, self.kv = self.programs.get("T", size)(
            self._compute, self.kv, self._prev_ids, step)
        pair = self.programs.get("R", size)(self._compute, hidden, row_tok, row_prev, *sb)
        next_ids, out, self.kv = program(self._compute, self.kv, self._prev_ids, step, *sb)
        return all(np.asarray(a).tobytes() == np.asarray(b).tobytes()
                   for a, b in zip(jax.tree.leaves(pair), jax.tree.leaves((next_ids, out)),
                                   strict=True))

    @property
    def cache_miss_count(self) -> int:
        """Programs compiled on the step path after warm-up began (must stay 0: a step
        only picks compiled buckets)."""
        return self._step_compiles if self._warm_started else 0

    def _program(self, kind: str, size: int, inputs: tuple[Any, ...], host_tree: Any) -> Any:
        """The compiled program of a bucket; `host_tree` is what its packed input holds."""
        program = self.programs.get(kind, size)
        if program is None:  # warm-up off, or a caller forced an uncompiled bucket
            self._step_compiles += 1
            program = self._compile(_abstract(inputs, self.replicated), layout_of(host_tree),
                                    kind, size)
            self.programs.add_ready(kind, size, program)
        return program

    # ---- running -------------------------------------------------------------------
    # A program's host inputs are handed to its call as NumPy arrays: the compiled call
    # moves them to the device with its input sharding (replicated) in its own C++ path.
    # A Python `jax.device_put` first costs the same transfer plus ~0.5 ms of host time at
    # one decode row, taken from the cores the step runs on (docs/performance.md §1).
    def step_inputs(self, arrays: StepArrays) -> np.ndarray:
        """A T program's step arrays: one packed int32 host array."""
        return pack(step_tree(arrays))

    def sampling_inputs(self, sb_host: sampling.SamplingBatch
                        ) -> tuple[np.ndarray, Any, Any, Any]:
        """An R program's sampling inputs: the small fields packed into one int32 host
        array, then output_counts, prompt_mask and token_mask (host arrays, or the engine's
        cached device zeros while no row has a penalty / a grammar)."""
        return (pack(_small_sampling_fields(sb_host)), sb_host.output_counts,
                sb_host.prompt_mask, sb_host.token_mask)

    def _forward(self, arrays: StepArrays) -> tuple[jax.Array, jax.Array, jax.Array, KVPool]:
        assert self.kv is not None, "KV pool released: resume memory before running"
        inputs = (self._compute, self.kv, self._prev_ids, self.step_inputs(arrays))
        return self._program("T", arrays.input_ids.shape[0], inputs,
                             step_tree(arrays))(*inputs)

    def fused_program(self, tokens: int, rows: int) -> Any | None:
        """The ready fused program of a step padded to `tokens` tokens and `rows` logits
        rows (buckets), or None: the step runs its forward and head programs."""
        return self.programs.get("S", tokens) if (
            tokens == rows and tokens in self.programs.ready("S")) else None

    def run(self, arrays: StepArrays, sb_host: Any, wants_logprobs: bool,
            num_rows: int) -> StepOutput:
        """Launch one step: `num_rows` (a row bucket) logits rows, sampled with `sb_host`
        (built by `sampling_batch(specs, num_rows)`): one fused program where it has one
        (`fused_program`), else the forward and the head."""
        fused = self.fused_program(arrays.input_ids.shape[0], num_rows)
        if fused is not None:
            assert self.kv is not None, "KV pool released: resume memory before running"
            next_ids, out, self.kv = fused(self._compute, self.kv, self._prev_ids,
                                           self.step_inputs(arrays),
                                           *self.sampling_inputs(sb_host))
            self.fused_steps += 1
        else:
            hidden, row_tok, row_prev, self.kv = self._forward(arrays)
            inputs = (self._compute, hidden, row_tok, row_prev,
                      *self.sampling_inputs(sb_host))
            next_ids, out = self._program("R", num_rows, inputs,
                                          _small_sampling_fields(sb_host))(*inputs)
        self._prev_ids = next_ids
        return StepOutput(next_ids=next_ids, sample=out, num_rows=num_rows,
                          wants_logprobs=wants_logprobs)

    def reset_prev_ids(self) -> None:
        self._prev_ids = jax.device_put(np.zeros(self.max_rows, np.int32), self.replicated)

    def drop_step_buffers(self) -> None:
        """Free the small per-step device buffers (memory release: engine/rl/memory.py).
        `reset_prev_ids()` brings back the only one a step needs; zeros are re-made lazily."""
        buffers = [self._prev_ids, *(a for z in self._zero_cache.values() for a in z),
                   *self._mask_zero_cache.values()]
        self._zero_cache.clear()
        self._mask_zero_cache.clear()
        self._prev_ids = None
        for a in buffers:
            if a is not None and not a.is_deleted():
                a.delete()

    def sampling_batch(self, rows: Sequence[sampling_host.RowSpec | None],
                       num_rows: int) -> sampling.SamplingBatch:
        """Host sampling inputs for one step of `num_rows` logits rows (padded to
        `sampler_rows`); penalty-free steps reuse this engine's device-resident zero
        [rows, V] arrays (a per-engine cache, never module-level)."""
        rows_padded = sampler_rows(num_rows)
        if rows_padded not in self._zero_cache:
            zeros = sampling_host.penalty_zeros(rows_padded, self.model_cfg.vocab_size)
            self._zero_cache[rows_padded] = sampling_host.PenaltyZeros(
                *jax.device_put(tuple(zeros), self.replicated))
            self._mask_zero_cache[rows_padded] = jax.device_put(
                sampling_host.mask_zeros(rows_padded, self.model_cfg.vocab_size),
                self.replicated)
        return sampling_host.build_sampling_batch(rows, rows_padded,
                                                  self.model_cfg.vocab_size,
                                                  zeros=self._zero_cache[rows_padded],
                                                  no_masks=self._mask_zero_cache[rows_padded])


def _sample_impl(logits: jax.Array, tok: jax.Array, prev: jax.Array, packed: jax.Array,
                 output_counts: jax.Array, prompt_mask: jax.Array, token_mask: jax.Array, *,
                 layout: Layout, max_rows: int) -> tuple[jax.Array, Any]:
    """The head's second program: the sampler over the padded rows, and the sampled ids in
    the [max_rows] buffer the next forward reads (rows past the step's are padding).
    Penalties count output tokens; the host does not know the ids still on device: the
    sampler counts them for rows whose input came from the previous step (only when some
    row has a penalty: no [R, V] array is touched otherwise)."""
    sb = unpack(packed, layout).replace(output_counts=output_counts, prompt_mask=prompt_mask,
                                        token_mask=token_mask, unread_token=tok,
                                        has_unread=prev)
    out = sampling.sample(logits, sb)
    rows = min(logits.shape[0], max_rows)
    next_ids = jnp.zeros(max_rows, jnp.int32).at[:rows].set(out.next_ids[:rows])
    return next_ids, out


class HeadProgram:
    """An R bucket's compiled head: the logits program of its rows, then the sampler program
    of its sampler rows (shared by the R buckets of one chunk count). Called like one
    program: (params, hidden, row_tok, row_prev, packed, output_counts, prompt_mask,
    token_mask) -> (next_ids [max_rows], SampleOutput)."""

    def __init__(self, logits: Any, sampler: Any) -> None:
        self.logits, self.sampler = logits, sampler

    def __call__(self, params: Any, hidden: jax.Array, row_tok: jax.Array,
                 row_prev: jax.Array, *sb: jax.Array) -> tuple[jax.Array, Any]:
        return self.sampler(*self.logits(params, hidden, row_tok, row_prev), *sb)


def _check_rows(size: int, vocab: int) -> list[sampling_host.RowSpec]:
    """The sampling rows of a fused step's check, alternately: seeded sampling with top-k /
    top-p / min-p, every penalty and a grammar's token mask (every even id allowed); greedy.
    All with logprobs and top logprobs."""
    sampled = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.01,
                             frequency_penalty=0.5, presence_penalty=0.25,
                             repetition_penalty=1.1, return_logprob=True,
                             top_logprobs_num=MAX_TOP_LOGPROBS)
    greedy = SamplingParams(temperature=0.0, return_logprob=True,
                            top_logprobs_num=MAX_TOP_LOGPROBS)
    evens = np.full(sampling_host.mask_words(vocab), 0x55555555, np.int32)
    return [sampling_host.RowSpec(params=greedy if b % 2 else sampled, seed=1000 + b,
                                  sample_index=0, position=1, output_ids=(1, 3 + b),
                                  prompt_ids=(2, 5, 7), token_mask=None if b % 2 else evens)
            for b in range(size)]


def step_tree(arrays: StepArrays) -> dict[str, np.ndarray]:
    """The step arrays a T program reads, by name."""
    return {k: getattr(arrays, k) for k in ARRAY_FIELDS}


def _small_sampling_fields(sb: sampling.SamplingBatch) -> sampling.SamplingBatch:
    """`sb` without its [R, V] (and [R, V/32]) arrays (None: no leaves), the part an R
    program gets packed."""
    return sb.replace(output_counts=None, prompt_mask=None, token_mask=None)


def _abstract(tree: Any, host_sharding: Any) -> Any:
    """The abstract shape (shape, dtype, sharding) of every array leaf of `tree`; a host
    (NumPy) leaf is given `host_sharding`, the sharding its program's call moves it to."""
    return jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                       sharding=getattr(a, "sharding", host_sharding)), tree)
