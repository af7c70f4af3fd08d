"""The compiled step programs of one engine, and the order they are compiled in.

A step runs two programs (runner.py, step_programs.py): a forward over T tokens
(`ProgramKind.FORWARD`, "T", one per token bucket) and a head over R logits rows
(`ProgramKind.HEAD`, "R", one per row bucket); a decode step of b tokens and b rows may
instead run one fused program (`ProgramKind.FUSED`, "S", b in the config's fused step
sizes), and K such steps one decode-steps program (`ProgramKind.DECODE_STEPS`, "M", while
the config's decode_steps_per_dispatch K > 1); each is primed only after its T and R are
compiled and checked against them bit for bit (`needs`): one that differs is rejected,
never chosen. They are compiled ahead
of time (`jax.jit(...).lower(...).compile()`) and the step calls the compiled executables
directly, so a step never traces or compiles: a shape without a program is never chosen.

Serving before every program is compiled. The model is row-invariant at every bucket
(model/invariance/primitives.py, model/layers/attention.py): a step padded to a larger bucket gives every
real row bitwise the same result. So an engine needs only a *covering* set to serve every
step shape: the largest token bucket and the largest row bucket (plus the scanned token
buckets, T > the family's `unroll_max_tokens`, which compile quickly and keep a lone decode
off the largest bucket). `plan()` splits the buckets into that first phase and the rest; with
`background` the rest compile on a background thread per engine while the engine serves,
smallest first (a lone decode's T = 1, R = 1 first). Each compiled program is then primed
(run once) on the engine thread between steps and only then joins the ready set; the step
picks the smallest ready bucket that fits (engine/base/buckets.py `smallest_fit`).
Outputs are identical either way; only speed differs until the set is complete. The
unrolled small-T forwards are most of the compile time (several times a scanned one's
each, docs/performance.md §6): they go last.

Ownership (one writer each): `_programs` (compiled executables) is written by the compiling
thread (the warm-up caller, then the background thread), each program stored before it is
handed over; `_ready` and `_pending` by the owner of the engine's device state (the warm-up
caller before the engine serves, then the engine thread, which primes), `_ready` as an
immutable tuple swapped whole so a reader sees a consistent set under the GIL. The handover
between the two (`set_primer`, `_unprimed`) is under `_handoff`. `COMPILE_SLOTS` bounds the
background compiles running at once in the process (a fleet's engines share the cores).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

# Background compiles running at once in this process (all engines): as many as the warm-up
# uses (StepPrograms.compile_threads), so a fleet of 4 engines on 2 cores runs 2, not 8.
COMPILE_SLOT_COUNT = max(1, min(4, os.cpu_count() or 1))
COMPILE_SLOTS = threading.BoundedSemaphore(COMPILE_SLOT_COUNT)


class ProgramKind(StrEnum):
    """What a step program computes. The value is the program's name in reports ("T=4" in
    get_internal_state's "compile", `progress(kind, size)`, the Prime command): a str, so
    it equals (and hashes as) its letter. It names a program only; it never reaches the
    lowered module or the compilation cache keys (program_share.py hashes the HLO)."""

    FORWARD = "T"  # the decoder over T tokens
    HEAD = "R"  # lm_head and sampler over R logits rows
    FUSED = "S"  # forward, head and sampler of a b-token, b-row decode step in one program
    # K (EngineConfig.decode_steps_per_dispatch) fused decode steps of b rows in one
    # program ("M": many steps; "M=8" is the program of 8 rows)
    DECODE_STEPS = "M"


# compile order at equal size (`plan`): forward, head, then the fused step and the
# decode-steps program that need both
KINDS: tuple[ProgramKind, ...] = (ProgramKind.FORWARD, ProgramKind.HEAD, ProgramKind.FUSED,
                                  ProgramKind.DECODE_STEPS)


class Program(Protocol):
    """A compiled step program: called with device or host arrays, returns device arrays
    (a `jax.stages.Compiled`, or step_programs.HeadProgram, two of them called as one)."""

    def __call__(self, *args: Any) -> Any: ...


def needs(kind: ProgramKind, size: int) -> tuple[tuple[ProgramKind, int], ...]:
    """The programs a program is checked against when it is primed: a fused step (FUSED, b)
    against the forward and head of its size, which it must equal bit for bit; a
    decode-steps program (DECODE_STEPS, b) against as many steps of that forward and head."""
    return (((ProgramKind.FORWARD, size), (ProgramKind.HEAD, size))
            if kind in (ProgramKind.FUSED, ProgramKind.DECODE_STEPS) else ())

# Sets whose background thread is running. At interpreter exit each is stopped and its
# compile in progress waited for (`stop_background_compiles`): a daemon thread still inside
# XLA when the interpreter finalizes is ended by a forced unwind that XLA's C++ does not
# rethrow, and the process aborts ("terminate called ...", exit 134) instead of exiting
# with the script's own status. Background compile workers are daemon threads, so that
# exit waits only for the compile in progress, not for every queued one (a
# ThreadPoolExecutor's workers are joined, queue and all, before atexit hooks run).
_BACKGROUND: set[ProgramSet] = set()
_BACKGROUND_LOCK = threading.Lock()
_EXIT_HOOK_REGISTERED = False


@contextlib.contextmanager
def background_compiles_held(timeout: float = 600.0) -> Iterator[None]:
    """Hold every COMPILE_SLOT: no background compile starts in this process until the
    block ends (one in progress finishes first; waits for it up to `timeout` s). The fleet
    launcher builds all its engines inside it, so that an engine's background compiles do
    not slow the next engine's start-up: READY first, the small buckets after."""
    held = 0
    try:
        while held < COMPILE_SLOT_COUNT and COMPILE_SLOTS.acquire(timeout=timeout):
            held += 1
        if held < COMPILE_SLOT_COUNT:
            raise TimeoutError(f"a background compile held its slot for over {timeout} s")
        yield
    finally:
        for _ in range(held):
            COMPILE_SLOTS.release()


def background_compiles_running() -> int:
    """How many engines of this process are compiling programs in the background."""
    with _BACKGROUND_LOCK:
        return len(_BACKGROUND)


def stop_background_compiles() -> None:
    """Stop every background compile in the process (none starts any more), then wait for
    the ones in progress to finish. Run at interpreter exit (`_register_exit_hook`)."""
    with _BACKGROUND_LOCK:
        running = list(_BACKGROUND)
    for programs in running:
        programs.stop()
    for programs in running:
        programs.stop(timeout=None)


def _register_exit_hook() -> None:
    """Register `stop_background_compiles` at exit, once, when the first background compile
    starts: jax is imported by then, and atexit runs hooks last-in first-out, so this one
    runs before jax's own (which drops the backends a compile in progress uses)."""
    global _EXIT_HOOK_REGISTERED
    with _BACKGROUND_LOCK:
        if _EXIT_HOOK_REGISTERED:
            return
        _EXIT_HOOK_REGISTERED = True
    atexit.register(stop_background_compiles)


@dataclass(frozen=True)
class Plan:
    """Which programs compile before the engine serves (`first`) and which after (`rest`,
    in compile order)."""

    first: tuple[tuple[ProgramKind, int], ...]
    rest: tuple[tuple[ProgramKind, int], ...]


def plan(token_buckets: Sequence[int], row_buckets: Sequence[int], unroll_max_tokens: int,
         background: bool, fused: Sequence[int] = (),
         decode_steps: Sequence[int] = ()) -> Plan:
    """Split the programs: without `background` everything is `first` (the fused steps
    last); with it, `first` is the covering set (largest T and R, and every scanned T) and
    `rest` the others, ordered by size (T, then R, then the fused step S and the
    decode-steps program M at equal size: each is only ever a faster way to run a T and
    an R, never needed to serve)."""
    forward, head = ProgramKind.FORWARD, ProgramKind.HEAD
    everything = ([(forward, t) for t in token_buckets] + [(head, r) for r in row_buckets]
                  + [(ProgramKind.FUSED, b) for b in fused]
                  + [(ProgramKind.DECODE_STEPS, b) for b in decode_steps])
    if not background:
        return Plan(first=tuple(everything), rest=())
    first = {(forward, max(token_buckets)), (head, max(row_buckets))}
    first |= {(forward, t) for t in token_buckets if t > unroll_max_tokens}
    rest = sorted((p for p in everything if p not in first),
                  key=lambda p: (p[1], KINDS.index(p[0])))
    return Plan(first=tuple(p for p in everything if p in first), rest=tuple(rest))


@dataclass
class CompileStatus:
    """What `status()` reports (get_internal_state "compile")."""

    ready_s: float | None = None  # warm-up start -> serving (the first phase compiled)
    complete_s: float | None = None  # warm-up start -> every program compiled
    compiled: list[str] = field(default_factory=list)
    pending: list[str] = field(default_factory=list)
    error: str | None = None  # a background compile failed: the engine serves on without it
    compiling: bool = False  # the background thread is running
    # compiled programs that failed their check when primed (a fused step whose bits
    # differ from its forward and head on this backend): never used
    rejected: list[str] = field(default_factory=list)


class ProgramSet:
    """The step programs of one engine (see the module docstring for who writes what).

    A program is compiled (`compile_program(kind, size)` -> executable; it must not touch
    live device arrays: step_programs.py lowers from abstract shapes), then *primed* — run once
    by the engine's owner thread, which pays the first execution's one-off costs (buffer
    allocation: seconds for a large forward, docs/performance.md §6) outside a request —
    and only then ready, i.e. chosen by steps. Background compiles are handed to the
    engine thread for priming through `set_primer`."""

    def __init__(self, compile_program: Callable[[ProgramKind, int], Program],
                 prime_program: Callable[[ProgramKind, int, Program], bool | None]) -> None:
        self._compile_program = compile_program
        self._prime_program = prime_program
        # compiled (compiling thread)
        self._programs: dict[tuple[ProgramKind, int], Program] = {}
        self._ready: dict[ProgramKind, tuple[int, ...]] = {k: () for k in KINDS}  # primed (owner)
        self._rejected: tuple[str, ...] = ()  # failed their prime's check (owner)
        # could not be primed yet (owner)
        self._deferred: tuple[tuple[ProgramKind, int], ...] = ()
        self._pending: tuple[tuple[ProgramKind, int], ...] = ()
        self._handoff = threading.Lock()  # guards _primer and _unprimed
        self._primer: Callable[[ProgramKind, int], Any] | None = None
        self._unprimed: list[tuple[ProgramKind, int]] = []
        self._stop = threading.Event()
        self._complete = threading.Event()
        self._on_complete: Callable[[], None] | None = None
        self._thread: threading.Thread | None = None
        self._t0: float | None = None
        self._all_planned = False  # compile_rest has added the rest to _pending
        self.ready_s: float | None = None
        self.complete_s: float | None = None
        self.error: BaseException | None = None

    # ---- readers (any thread) -----------------------------------------------------
    def ready(self, kind: ProgramKind) -> tuple[int, ...]:
        return self._ready[kind]

    def get(self, kind: ProgramKind, size: int) -> Program | None:
        return self._programs.get((kind, size))

    def wait_complete(self, timeout: float | None = None) -> bool:
        """Block until every planned program is ready (True) or the timeout ends."""
        return self._complete.wait(timeout)

    def status(self) -> CompileStatus:
        ready = self._ready
        return CompileStatus(
            ready_s=self.ready_s, complete_s=self.complete_s,
            compiled=[f"{k}={s}" for k in KINDS for s in ready[k]],
            pending=[f"{k}={s}" for k, s in self._pending],
            error=None if self.error is None else f"{type(self.error).__name__}: {self.error}",
            compiling=self._thread is not None and self._thread.is_alive(),
            rejected=list(self._rejected))

    @classmethod
    def on_demand(cls) -> ProgramSet:
        """A set with nothing planned (warm-up off): StepPrograms adds programs as steps
        need them, and there is nothing to wait for."""

        def unplanned(*args: Any) -> Any:
            raise AssertionError(f"nothing is planned: {args[:2]}")

        programs = cls(unplanned, unplanned)
        programs._complete.set()
        return programs

    # ---- the owner of the engine's device state (warm-up, then the engine thread) ---
    def add_ready(self, kind: ProgramKind, size: int, program: Program) -> None:
        """Store and publish a program the owner compiled itself (warm-up off)."""
        self._programs[(kind, size)] = program
        self._publish(kind, size)

    def prime_and_publish(self, kind: ProgramKind, size: int) -> None:
        """Run a compiled program once, then let steps choose it (the owner's thread).
        `prime_program` returns True (publish), False (its check failed: rejected, never
        chosen) or None (it cannot run now, the engine's memory is released: pending
        until `prime_deferred`)."""
        verdict = self._prime_program(kind, size, self._programs[(kind, size)])
        if verdict is None:
            self._deferred = (*self._deferred, (kind, size))
        elif verdict:
            self._publish(kind, size)
        else:
            self._rejected = (*self._rejected, f"{kind}={size}")
            self._settle(kind, size)

    def prime_deferred(self) -> None:
        """Prime the programs deferred while memory was released (the owner's thread, once
        weights and KV are back)."""
        deferred, self._deferred = self._deferred, ()
        for kind, size in deferred:
            self.prime(kind, size)

    def _publish(self, kind: ProgramKind, size: int) -> None:
        self._ready = {**self._ready, kind: tuple(sorted({*self._ready[kind], size}))}
        self._settle(kind, size)

    def _settle(self, kind: ProgramKind, size: int) -> None:
        """`(kind, size)` is no longer pending (published or rejected)."""
        self._pending = tuple(p for p in self._pending if p != (kind, size))
        if not self._pending and self._all_planned:
            self._finish()

    def _finish(self) -> None:
        """Every planned program is ready: record the time, wake waiters, run on_complete
        (once)."""
        if self._complete.is_set():
            return
        self.complete_s = time.monotonic() - (self._t0 or time.monotonic())
        self._complete.set()
        if self._on_complete is not None:
            self._on_complete()

    def set_primer(self, submit: Callable[[ProgramKind, int], Any]) -> None:
        """From now on, hand each background-compiled program to `submit(kind, size)`,
        which has the engine thread run `prime(kind, size)` between steps (the Engine's
        typed command Prime); the ones compiled before are handed now."""
        with self._handoff:
            self._primer = submit
            backlog, self._unprimed = self._unprimed, []
        for kind, size in backlog:
            self._hand_over(kind, size)

    def _hand_over(self, kind: ProgramKind, size: int) -> None:
        with self._handoff:
            submit = self._primer
            if submit is None:
                self._unprimed.append((kind, size))
                return

        try:
            submit(kind, size)
        except Exception:  # noqa: BLE001 - the engine has stopped: nothing to prime for
            pass

    def prime(self, kind: ProgramKind, size: int) -> None:
        """`prime_and_publish` (the engine thread); a failure is reported via status and
        the engine serves on without this program."""
        try:
            self.prime_and_publish(kind, size)
        except Exception as e:  # noqa: BLE001 - reported via status; the engine serves on
            self.error = e

    # ---- compiling ---------------------------------------------------------------
    def _store(self, progress: Callable[[ProgramKind, int], None] | None
               ) -> Callable[[ProgramKind, int, Program], None]:
        """Keep a compiled program (the compiling thread), then report it to `progress`."""
        def store(kind: ProgramKind, size: int, program: Program) -> None:
            self._programs[(kind, size)] = program
            if progress is not None:
                progress(kind, size)
        return store

    def compile_first(self, programs: Sequence[tuple[ProgramKind, int]], threads: int,
                      progress: Callable[[ProgramKind, int], None] | None = None) -> None:
        """Compile `programs` with `threads` compile threads, then prime and publish each
        (blocking; the caller owns the engine's device state). Lowering is Python and
        serial; XLA compiles release the GIL."""
        self._t0 = time.monotonic()
        self._pending = tuple(programs)
        _compile_each(programs, threads, self._compile_program, self._store(progress))
        for kind, size in programs:
            self.prime_and_publish(kind, size)
        self.ready_s = time.monotonic() - self._t0

    def compile_rest(self, programs: Sequence[tuple[ProgramKind, int]], threads: int,
                     progress: Callable[[ProgramKind, int], None] | None = None,
                     on_complete: Callable[[], None] | None = None) -> None:
        """Compile the remaining programs on a background thread while the engine serves:
        started in order by `threads` workers, each holding one of COMPILE_SLOTS, none
        started after `stop()`. Each compiled program goes to the engine thread to be
        primed and published (`set_primer`); `on_complete()` runs once all are ready."""
        self._on_complete = on_complete
        self._pending = (*self._pending, *programs)
        self._all_planned = True
        if not programs:
            self._finish()
            return

        def compile_one(kind: ProgramKind, size: int) -> Program | None:
            while not COMPILE_SLOTS.acquire(timeout=0.05):  # stop() need not wait for a slot
                if self._stop.is_set():
                    return None
            try:
                return None if self._stop.is_set() else self._compile_program(kind, size)
            finally:
                COMPILE_SLOTS.release()

        store = self._store(progress)
        held: list[tuple[ProgramKind, int]] = []  # compiled before the programs they need

        def compiled(kind: ProgramKind, size: int, program: Program) -> None:
            store(kind, size, program)  # stored before it is handed over
            held.append((kind, size))
            for p in list(held):  # in compile order, each once all it `needs` are stored
                if all(q in self._programs for q in needs(*p)):
                    held.remove(p)
                    self._hand_over(*p)

        def run() -> None:
            try:
                _compile_each(programs, threads, compile_one, compiled, daemon=True)
            except BaseException as e:  # noqa: BLE001 - reported via status/error, engine serves on
                self.error = e
            finally:
                with _BACKGROUND_LOCK:
                    _BACKGROUND.discard(self)

        self._thread = threading.Thread(target=run, name="compile-background", daemon=True)
        _register_exit_hook()
        with _BACKGROUND_LOCK:
            _BACKGROUND.add(self)
        self._thread.start()

    def stop(self, timeout: float | None = 0.0) -> None:
        """No further program starts compiling. Waits up to `timeout` s (None: until done)
        for the background thread, which ends once a compile in progress finishes (an XLA
        compile cannot be interrupted; at most seconds). Engine.shutdown does not wait;
        interpreter exit does (`stop_background_compiles`)."""
        self._stop.set()
        if (self._thread is not None and self._thread is not threading.current_thread()
                and (timeout is None or timeout > 0)):
            self._thread.join(timeout)


def _compile_each(programs: Sequence[tuple[ProgramKind, int]], threads: int,
                  compile_one: Callable[[ProgramKind, int], Program | None],
                  compiled: Callable[[ProgramKind, int, Program], None],
                  daemon: bool = False) -> None:
    """Run compile_one for every program on `threads` workers (started in order) and call
    compiled(kind, size, program) on this thread as each finishes; a None result (stopped)
    is skipped. Lowering is Python; XLA compiles release the GIL. If anything raises (a
    compile, `compiled`, an interrupt), no further program starts and the workers are
    joined (a compile in progress finishes) before it propagates. `daemon` workers do not
    hold up interpreter exit (the background compiles: their exit hook stops them)."""
    todo: queue.SimpleQueue[tuple[ProgramKind, int]] = queue.SimpleQueue()
    for planned in programs:
        todo.put(planned)
    done: queue.SimpleQueue[tuple[ProgramKind, int, Program | None, BaseException | None]] = (
        queue.SimpleQueue())

    def work() -> None:
        while True:
            try:
                kind, size = todo.get_nowait()
            except queue.Empty:
                return
            try:
                done.put((kind, size, compile_one(kind, size), None))
            except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
                done.put((kind, size, None, e))

    workers = [threading.Thread(target=work, name=f"compile-{i}", daemon=daemon)
               for i in range(max(1, min(threads, len(programs))))]
    for worker in workers:
        worker.start()
    try:
        for _ in programs:
            kind, size, program, error = done.get()
            if error is not None:
                raise error
            if program is not None:
                compiled(kind, size, program)
    finally:
        while True:  # nothing further starts (a no-op once every program was taken)
            try:
                todo.get_nowait()
            except queue.Empty:
                break
        for worker in workers:
            worker.join()
