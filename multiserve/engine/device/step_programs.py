"""The compiled step programs of one engine: compiling, warming, priming and checking them.

`StepPrograms` lowers the step functions (step_functions.py) from abstract inputs and
compiles them (through program_share.py), plans and runs the warm-up (programs.py's
`ProgramSet`: the covering buckets first, the rest optionally in the background), primes
each compiled program on the engine's live device state (runner.py, through the
`DeviceState` it offers), and answers which program runs a step.

The programs (programs.ProgramKind):
- FORWARD, one per token bucket T (`precompile_token_paddings`): a `jax.stages.Compiled`;
- HEAD, one per row bucket R (`precompile_bs_paddings`): a `HeadProgram`, the logits
  program of R rows then the sampler program of its sampler rows, which depends on nothing
  else but the vocabulary and max_rows (shared by the R buckets of one chunk count, and by
  engines of one vocabulary through the compilation caches);
- FUSED, one per fused step size b (`fused_step_sizes`): forward, head and sampler of a
  b-token, b-row decode step in one `jax.stages.Compiled`, which such a step runs instead
  of the two: one execution instead of three saves each step's hand-offs between programs
  (docs/performance.md §20). Its prime checks it against the forward and head of its size
  bit for bit (`fused_step_agrees`); a program that differs is rejected and the step runs
  the two;
- DECODE_STEPS, one per fused step size b while `decode_steps_per_dispatch` K > 1 (none with
  routing replay): K fused decode steps of b rows in one compiled loop, which a decode
  step whose rows need no host decision between tokens runs instead of K dispatches
  (engine/sched/scheduler.py `_decode_steps`). Its prime checks it against K steps of the forward
  and head of its size bit for bit, seeded and greedy (`decode_steps_agree`); a program
  that differs is rejected and the steps run one per dispatch.
So |T| + |R| (+ fused, + decode-steps) programs are compiled, not |T| x |R|, and a lone
decode runs at T = R = 1.

Invariants:
- Steps call compiled executables, never `jax.jit` dispatch: a step cannot trace or
  compile. `warmup()` compiles the covering buckets, then the rest; `compiled_buckets`
  names only primed buckets once warm-up began, so `cache_miss_count` (programs compiled
  on the step path) stays 0 after warm-up.
- Each program is lowered with the static layout of its bucket's inputs
  (`_abstract_inputs`; on demand, of the step's own), from abstract shapes only: compiling
  (any thread) never reads live device arrays; priming (the engine's owner thread) does.
- Every program is compiled with the runner's XLA options (`xla_options`), through
  program_share.SHARE, the one place programs are made.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from multiserve.config import EngineConfig
from multiserve.engine.device.program_share import SHARE
from multiserve.engine.device.programs import (
    Plan,
    Program,
    ProgramKind,
    ProgramSet,
    plan,
)
from multiserve.engine.device.step_functions import StepFunctions
from multiserve.engine.sampling import sampler as sampling
from multiserve.engine.step_inputs import sampling_batch as sampling_host
from multiserve.engine.step_inputs.packed import Layout, layout_of
from multiserve.engine.step_inputs.program_inputs import (
    sampling_inputs,
    small_sampling_fields,
    step_inputs,
    step_tree,
)
from multiserve.engine.step_inputs.sampling_zeros import sampler_rows
from multiserve.engine.step_inputs.token_arrays import StepArrays, empty_step_arrays
from multiserve.model.layers.kv_pool import KVPool
from multiserve.types import MAX_TOP_LOGPROBS, SamplingParams

FORWARD, HEAD, FUSED, DECODE_STEPS = (ProgramKind.FORWARD, ProgramKind.HEAD,
                                      ProgramKind.FUSED, ProgramKind.DECODE_STEPS)


class ForwardProgram(Protocol):
    """A FORWARD program: (params, kv, prev_ids, packed step) -> (hidden [max_rows, D],
    row ids, rows from the previous step, kv[, expert ids: routing replay,
    step_functions.py]); the KV pool is donated."""

    def __call__(self, params: Any, kv: KVPool, prev_ids: jax.Array, packed: np.ndarray,
                 /) -> tuple[Any, ...]: ...


class FusedProgram(Protocol):
    """A FUSED program: (params, kv, prev_ids, packed step, *sampling inputs) ->
    (next_ids [max_rows], SampleOutput, kv[, expert ids]); the KV pool is donated."""

    def __call__(self, params: Any, kv: KVPool, prev_ids: jax.Array, packed: np.ndarray,
                 *sb: Any) -> tuple[Any, ...]: ...


class DecodeStepsProgram(Protocol):
    """A DECODE_STEPS program: a FUSED program's arguments -> (the last step's ids
    [max_rows], every step's ids [K, max_rows], every step's SampleOutput (leaves
    [K, ...]), kv); the KV pool is donated."""

    def __call__(self, params: Any, kv: KVPool, prev_ids: jax.Array, packed: np.ndarray,
                 *sb: Any) -> tuple[Any, ...]: ...


class HeadProgram:
    """A HEAD bucket's compiled head: the logits program of its rows, then the sampler
    program of its sampler rows (shared by the R buckets of one chunk count). Called like
    one program: (params, hidden, row_tok, row_prev, packed, output_counts, prompt_mask,
    token_mask) -> (next_ids [max_rows], SampleOutput)."""

    def __init__(self, logits: jax.stages.Compiled, sampler: jax.stages.Compiled) -> None:
        self.logits, self.sampler = logits, sampler

    def __call__(self, params: Any, hidden: jax.Array, row_tok: jax.Array,
                 row_prev: jax.Array, *sb: Any) -> tuple[jax.Array, sampling.SampleOutput]:
        return self.sampler(*self.logits(params, hidden, row_tok, row_prev), *sb)


class DeviceState(Protocol):
    """What priming reads and writes of the engine's device state (runner.Runner)."""

    kv: KVPool | None  # donated to each primed program and replaced by its output

    @property
    def compute_params(self) -> Any: ...

    @property
    def prev_ids(self) -> jax.Array | None: ...

    @property
    def resident(self) -> bool: ...

    @property
    def lora_enabled(self) -> bool: ...

    def page_table_rows(self, num_tokens: int) -> int: ...

    def sampling_batch(self, rows: Sequence[sampling_host.RowSpec | None],
                       num_rows: int) -> sampling.SamplingBatch: ...


class StepPrograms:
    """One engine's step programs (see the module docstring). Readers of `set` (status,
    readiness) may be any thread; priming and `program` run on the owner of the device
    state (the warm-up caller, then the engine thread)."""

    def __init__(self, cfg: EngineConfig, functions: StepFunctions, mesh: Mesh,
                 xla_options: dict[str, bool | int], dtype: Any, state: DeviceState) -> None:
        self.cfg = cfg
        self.functions = functions
        self.devices = list(mesh.devices.flat)  # the executables' devices, in mesh order
        self.xla_options = xla_options
        self.dtype = dtype
        self.state = state
        self.max_rows = functions.max_rows
        self.replicated = functions.replicated
        self.set = ProgramSet.on_demand()  # replaced by warmup()
        self._warm_started = False
        self._step_compiles = 0
        self._prime_pages = 1
        # warm-up compiles in parallel; an engine alone on the host uses every core
        self.compile_threads = min(4, os.cpu_count() or 1)
        # sampler programs by sampler rows: the R buckets of one chunk count share one
        self._samplers: dict[int, jax.stages.Compiled] = {}
        self._sampler_locks: dict[int, threading.Lock] = {}
        self._samplers_lock = threading.Lock()

    # ---- which programs ------------------------------------------------------------
    def buckets(self) -> list[tuple[ProgramKind, int]]:
        """Every step program: FORWARD over tokens, HEAD over rows and FUSED decode
        steps."""
        return ([(FORWARD, t) for t in self.cfg.precompile_token_paddings]
                + [(HEAD, r) for r in self.cfg.precompile_bs_paddings]
                + [(FUSED, b) for b in self.cfg.fused_step_sizes]
                + [(DECODE_STEPS, b) for b in self.decode_steps_sizes])

    @property
    def decode_steps_sizes(self) -> tuple[int, ...]:
        """The sizes with a decode-steps program (EngineConfig.decode_steps_sizes), none in
        an engine with routing replay (its steps return each token's experts)."""
        return () if self.functions.routed_experts else self.cfg.decode_steps_sizes

    def compiled_buckets(self, kind: ProgramKind) -> Sequence[int]:
        """The sizes a step may pick for `kind`: the primed ones once warm-up began, every
        configured one while warm-up is off (those compile on first use)."""
        if self._warm_started:
            return self.set.ready(kind)
        return (self.cfg.precompile_token_paddings if kind == FORWARD
                else self.cfg.precompile_bs_paddings)

    def warmup_plan(self, background: bool) -> Plan:
        """Which programs `warmup` compiles before serving, and which after (programs.plan).
        The covering set takes the scanned token buckets too when some are unrolled (those
        compile several times slower and go last); when every size scans (native
        products), all compile alike and the largest token and row buckets cover."""
        tokens = self.cfg.precompile_token_paddings
        family, invariance_plan = self.functions.family, self.functions.plan
        all_scan = all(family.scans(invariance_plan, t) for t in tokens)
        return plan(tokens, self.cfg.precompile_bs_paddings,
                    max(tokens) if all_scan else family.unroll_max_tokens, background,
                    self.cfg.fused_step_sizes, self.decode_steps_sizes)

    @property
    def cache_miss_count(self) -> int:
        """Programs compiled on the step path after warm-up began (must stay 0: a step
        only picks compiled buckets)."""
        return self._step_compiles if self._warm_started else 0

    # ---- the program of a step (the engine thread) ---------------------------------
    def forward(self, arrays: StepArrays, inputs: tuple[Any, ...]) -> ForwardProgram:
        """The FORWARD program of the step's token bucket; `inputs` its arguments."""
        return cast(ForwardProgram, self.program(FORWARD, arrays.input_ids.shape[0], inputs,
                                                 step_tree(arrays)))

    def head(self, num_rows: int, sb_host: sampling.SamplingBatch,
             inputs: tuple[Any, ...]) -> HeadProgram:
        """The HEAD program of the row bucket `num_rows`; `inputs` its arguments."""
        return cast(HeadProgram, self.program(HEAD, num_rows, inputs,
                                              small_sampling_fields(sb_host)))

    def fused(self, tokens: int, rows: int) -> FusedProgram | None:
        """The ready FUSED program of a step padded to `tokens` tokens and `rows` logits
        rows (buckets), or None: the step runs its forward and head programs."""
        if tokens == rows and tokens in self.set.ready(FUSED):
            return cast(FusedProgram | None, self.set.get(FUSED, tokens))
        return None

    def decode_steps(self, tokens: int, rows: int) -> DecodeStepsProgram | None:
        """The ready DECODE_STEPS program of a decode step padded to `tokens` tokens and `rows`
        logits rows (buckets), or None: the step runs one step per dispatch."""
        if tokens == rows and tokens in self.set.ready(DECODE_STEPS):
            return cast(DecodeStepsProgram | None, self.set.get(DECODE_STEPS, tokens))
        return None

    def program(self, kind: ProgramKind, size: int, inputs: tuple[Any, ...],
                host_tree: Any) -> Program:
        """The compiled program of a bucket; `host_tree` is what its packed input holds.
        Compiled here, on the step path, only when warm-up is off or a caller forced an
        uncompiled bucket (`cache_miss_count`)."""
        program = self.set.get(kind, size)
        if program is None:
            self._step_compiles += 1
            program = self._compile(_abstract(inputs, self.replicated), layout_of(host_tree),
                                    kind, size)
            self.set.add_ready(kind, size, program)
        return program

    # ---- compiling (any thread) ----------------------------------------------------
    def _abstract_inputs(self, max_pages: int
                         ) -> dict[tuple[ProgramKind, int], tuple[tuple[Any, ...], Any]]:
        """The arguments of every program as abstract shapes (shape, dtype, sharding), and
        the layout of its packed input (that of the bucket's padding inputs: every step of
        the bucket has their structure, shapes and dtypes), captured now so that compiling
        later never reads live arrays (the engine thread donates the KV pool and replaces
        params)."""
        def spec(tree: Any) -> Any:
            return _abstract(tree, self.replicated)

        state = self.state
        hidden_size = self.functions.model_cfg.hidden_size
        params, kv, prev = spec(state.compute_params), spec(state.kv), spec(state.prev_ids)
        hidden = jax.ShapeDtypeStruct((self.max_rows, hidden_size), self.dtype,
                                      sharding=self.replicated)
        row_ids = jax.ShapeDtypeStruct((self.max_rows,), jnp.int32, sharding=self.replicated)
        row_prev = jax.ShapeDtypeStruct((self.max_rows,), jnp.bool_, sharding=self.replicated)
        out: dict[tuple[ProgramKind, int], tuple[tuple[Any, ...], Any]] = {}
        for kind, size in self.buckets():
            if kind == FORWARD:
                arrays = empty_step_arrays(size, state.page_table_rows(size), self.max_rows,
                                           max_pages, state.lora_enabled)
                out[(kind, size)] = ((params, kv, prev, spec(step_inputs(arrays))),
                                     layout_of(step_tree(arrays)))
            elif kind == HEAD:
                sb_host = state.sampling_batch([], size)
                sb = spec(sampling_inputs(sb_host))
                out[(kind, size)] = ((params, hidden, row_ids, row_prev, *sb),
                                     layout_of(small_sampling_fields(sb_host)))
        for size in self.cfg.fused_step_sizes:  # a forward's inputs, then a head's sampling
            (t_in, t_layout), (r_in, r_layout) = out[(FORWARD, size)], out[(HEAD, size)]
            out[(FUSED, size)] = ((*t_in, *r_in[4:]), (t_layout, r_layout))
        for size in self.decode_steps_sizes:  # a fused step's
            (t_in, t_layout), (r_in, r_layout) = out[(FORWARD, size)], out[(HEAD, size)]
            out[(DECODE_STEPS, size)] = ((*t_in, *r_in[4:]), (t_layout, r_layout))
        return out

    def _compile(self, inputs: tuple[Any, ...], layout: Any, kind: ProgramKind,
                 size: int) -> Program:
        """Lower and compile one program (any thread). The one place programs are made:
        compiled here, or loaded from another engine's compile of the same program
        (program_share.py: a fleet compiles each program once, not once per engine)."""
        fns = self.functions
        if kind == FORWARD:
            return SHARE.compile(fns.forward.lower(*inputs, layout=layout), self.devices,
                                 self.xla_options)
        if kind == FUSED:
            t_layout, r_layout = layout
            return SHARE.compile(fns.step.lower(*inputs, layout=t_layout,
                                                sample_layout=r_layout, num_rows=size),
                                 self.devices, self.xla_options)
        if kind == DECODE_STEPS:
            t_layout, r_layout = layout
            return SHARE.compile(fns.decode_steps.lower(
                *inputs, layout=t_layout, sample_layout=r_layout, num_rows=size,
                decode_steps=self.cfg.decode_steps_per_dispatch), self.devices,
                self.xla_options)
        params, hidden, row_tok, row_prev, *sb = inputs
        logits = SHARE.compile(fns.logits.lower(params, hidden, row_tok, row_prev,
                                                num_rows=size), self.devices, self.xla_options)
        return HeadProgram(logits, self._sampler(sampler_rows(size), sb, layout))

    def _sampler(self, rows: int, sb: list[Any], layout: Layout) -> jax.stages.Compiled:
        """The sampler program over `rows` rows (compiled once per engine and row count,
        any thread; `sb`: the abstract sampling inputs, `layout` their packed layout). It
        depends only on (rows, vocabulary, max_rows) and the XLA options (`xla_options`,
        which differ by dtype on the CPU: xla_options.step_options): engines of one
        vocabulary and dtype share it through the compilation caches, whatever their model."""
        with self._samplers_lock:  # one lock per row count: other counts compile meanwhile
            lock = self._sampler_locks.setdefault(rows, threading.Lock())
        with lock:
            program = self._samplers.get(rows)
            if program is None:
                def spec(shape: tuple[int, ...], dt: Any) -> jax.ShapeDtypeStruct:
                    return jax.ShapeDtypeStruct(shape, dt, sharding=self.replicated)

                vocab = self.functions.model_cfg.vocab_size
                lowered = self.functions.sample.lower(
                    spec((rows, vocab), jnp.float32), spec((rows,), jnp.int32),
                    spec((rows,), jnp.bool_), *sb, layout=layout, max_rows=self.max_rows)
                program = self._samplers[rows] = SHARE.compile(lowered, self.devices,
                                                               self.xla_options)
        return program

    # ---- warm-up (the owner of the device state) -----------------------------------
    def warmup(self, max_pages: int, progress: Callable[[ProgramKind, int], None] | None = None,
               background: bool = False, on_complete: Callable[[], Any] | None = None,
               on_first: Callable[[], None] | None = None) -> None:
        """Compile and prime the step programs (programs.py): the covering set first,
        blocking, with `compile_threads` threads; then (`background`) the rest on a thread
        while the engine serves — the engine primes those (`ProgramSet.set_primer`).
        `progress(kind, size)` is called as each program is compiled; `on_first()` once
        the covering set is ready, `on_complete()` once every program is."""
        inputs = self._abstract_inputs(max_pages)
        order = self.warmup_plan(background)
        self._warm_started = True
        self._prime_pages = max_pages
        self.set = ProgramSet(
            lambda kind, size: self._compile(*inputs[(kind, size)], kind, size), self._prime)
        self.set.compile_first(order.first, self.compile_threads, progress)
        if on_first is not None:
            on_first()
        self.set.compile_rest(order.rest, self.compile_threads, progress, on_complete)

    def _prime(self, kind: ProgramKind, size: int, program: Program) -> bool | None:
        """Run a compiled program once on padding inputs (the engine's owner thread): its
        first execution's one-off costs are paid here, not by a request, and a broken
        program fails here. Padding tokens write K/V only into the garbage page 0; the
        previous step's ids (`prev_ids`) are read, never replaced, so a step in flight is
        unaffected. Skipped while memory is released (no params / KV to run on).
        A fused step is also checked (`fused_step_agrees`): False rejects it; while memory
        is released its check waits (None) for `prime_deferred`.
        """
        state = self.state
        if not state.resident:
            return None if kind in (FUSED, DECODE_STEPS) else True
        if kind == FUSED:
            return self.fused_step_agrees(size, cast(FusedProgram, program))
        if kind == DECODE_STEPS:
            return self.decode_steps_agree(size, cast(DecodeStepsProgram, program))
        if kind == FORWARD:
            arrays = empty_step_arrays(size, state.page_table_rows(size), self.max_rows,
                                       self._prime_pages, state.lora_enabled)
            hidden, _, _, state.kv, *_ = program(state.compute_params, state.kv,
                                                 state.prev_ids, step_inputs(arrays))
            jax.block_until_ready(hidden)
            return True
        hidden = jnp.zeros((self.max_rows, self.functions.model_cfg.hidden_size), self.dtype,
                           device=self.replicated)
        rows = jnp.zeros((self.max_rows,), jnp.int32, device=self.replicated)
        sb = sampling_inputs(state.sampling_batch([], size))
        next_ids, _ = program(state.compute_params, hidden, rows, rows > 0, *sb)
        jax.block_until_ready(next_ids)
        return True

    def prime_deferred(self) -> None:
        """Memory is resident again: prime (and check) the programs that arrived while it
        was released. Between steps, on the engine thread."""
        if self.state.resident:
            self.set.prime_deferred()

    def fused_step_agrees(self, size: int, program: FusedProgram) -> bool:
        """Run fused step `program` and the forward + head of its size (`programs.needs`:
        compiled before it is primed) on one step, and say whether every output (sampled
        ids, logprobs, ...) is bitwise the same. The step: `size` tokens of one id at
        position 0, each its own sequence of one token (the same K/V into the garbage
        page 0's slot 0, read back by its attention), every row a logits row, sampled as
        `_check_rows` says (seeded sampling with filters, penalties and a token mask;
        greedy; logprobs and top logprobs): a real forward, head and every sampler path;
        with routing replay, the expert ids too."""
        state = self.state
        vocab = self.functions.model_cfg.vocab_size
        arrays = empty_step_arrays(size, state.page_table_rows(size), self.max_rows,
                                   self._prime_pages, state.lora_enabled)
        arrays.input_ids[:] = min(1, vocab - 1)
        arrays.token_seq[:] = np.arange(size) % arrays.seq_lens.shape[0]
        arrays.seq_lens[:] = 1
        arrays.logit_rows[:size] = np.arange(size)
        step = step_inputs(arrays)
        sb = sampling_inputs(state.sampling_batch(_check_rows(size, vocab), size))
        forward, head = self.set.get(FORWARD, size), self.set.get(HEAD, size)
        assert forward is not None and head is not None, "checked before its programs"
        prev_ids = state.prev_ids
        assert prev_ids is not None, "checked while memory is resident only"
        hidden, row_tok, row_prev, state.kv, *experts = forward(state.compute_params,
                                                                state.kv, prev_ids, step)
        pair = (*head(state.compute_params, hidden, row_tok, row_prev, *sb), *experts)
        next_ids, out, state.kv, *fused_experts = program(state.compute_params, state.kv,
                                                          prev_ids, step, *sb)
        return _same_bits(pair, (next_ids, out, *fused_experts))

    def decode_steps_agree(self, size: int, program: DecodeStepsProgram) -> bool:
        """Run decode-steps `program` and as many single steps (the forward + head of its
        size: `programs.needs`) on one decode step, and say whether every step's outputs
        (sampled ids, logprobs, ...) are bitwise those of its single step, and the last
        step's ids the next step's input. Twice: every row seeded-sampled, then every row
        greedy (`_decode_steps_check_params`). The step: `size` rows of one id at position
        0, each its own sequence, all rows alike (so the K/V every row writes into the
        garbage page 0's slot of each position, read back by the later steps, is the same
        whichever row's write lands last); the single steps are built on the host the
        way step_inputs/token_arrays.py builds the steps that follow (positions + 1, the ids
        from the previous step's rows)."""
        state = self.state
        vocab = self.functions.model_cfg.vocab_size
        decode_steps = self.cfg.decode_steps_per_dispatch
        forward, head = self.set.get(FORWARD, size), self.set.get(HEAD, size)
        assert forward is not None and head is not None, "checked before its programs"
        prev_ids = state.prev_ids
        assert prev_ids is not None, "checked while memory is resident only"

        def step_at(k: int) -> StepArrays:
            arrays = empty_step_arrays(size, state.page_table_rows(size), self.max_rows,
                                       self._prime_pages, state.lora_enabled)
            arrays.input_ids[:] = min(1, vocab - 1)
            if k > 0:
                arrays.from_prev[:] = np.arange(size)
            arrays.positions[:] = k
            arrays.token_seq[:] = np.arange(size)
            arrays.out_slots[:] = k % self.cfg.page_size  # page 0's slot of position k
            arrays.seq_lens[:] = k + 1
            arrays.logit_rows[:size] = np.arange(size)
            return arrays

        def sampling_at(params: SamplingParams, k: int) -> tuple[Any, ...]:
            specs = [sampling_host.RowSpec(params=params, seed=77, sample_index=0,
                                           position=1 + k, output_ids=(), prompt_ids=())
                     for _ in range(size)]
            return sampling_inputs(state.sampling_batch(specs, size))

        assert state.kv is not None, "checked while resident"
        for params in _decode_steps_check_params():
            last, ids, outs, state.kv = program(state.compute_params, state.kv, prev_ids,
                                                step_inputs(step_at(0)),
                                                *sampling_at(params, 0))
            prev = prev_ids
            for k in range(decode_steps):
                hidden, row_tok, row_prev, state.kv, *_ = forward(
                    state.compute_params, state.kv, prev, step_inputs(step_at(k)))
                prev, out = head(state.compute_params, hidden, row_tok, row_prev,
                                 *sampling_at(params, k))
                step_k = jax.tree.map(lambda a, k=k: np.asarray(a)[k], (ids, outs))
                if not _same_bits((prev, out), step_k):
                    return False
            if not _same_bits(prev, last):
                return False
        return True


def _decode_steps_check_params() -> tuple[SamplingParams, ...]:
    """The sampling of a decode-steps program's check, one run each: seeded sampling with
    top-k / top-p / min-p; greedy. Both with logprobs and top logprobs (no penalties,
    bans or grammar masks: steps with those never run several to a dispatch)."""
    return (SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.01,
                           return_logprob=True, top_logprobs_num=MAX_TOP_LOGPROBS),
            SamplingParams(temperature=0.0, return_logprob=True,
                           top_logprobs_num=MAX_TOP_LOGPROBS))


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


def _same_bits(a: Any, b: Any) -> bool:
    """Two pytrees of arrays (device or host) of one structure hold the same bytes."""
    return all(np.asarray(x).tobytes() == np.asarray(y).tobytes()
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def _abstract(tree: Any, host_sharding: Any) -> Any:
    """The abstract shape (shape, dtype, sharding) of every array leaf of `tree`; a host
    (NumPy) leaf is given `host_sharding`, the sharding its program's call moves it to."""
    return jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                       sharding=getattr(a, "sharding", host_sharding)), tree)
