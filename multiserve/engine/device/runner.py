"""Runner: the device state of one engine, and the launch of its steps.

Owns the device state of one engine: sharded params (their compute form, the layouts the
invariance plan's kernels read, and the canonical leaves that form does not hold exactly:
see the invariant on `params`), the model's family (model/families: the runner talks
only to that interface: compute params, forward to hidden states, head), the KV pool
(donated to every step, updated in place), the device buffer of the last step's sampled
ids, and the sampler's cached device zeros (engine/step_inputs/sampling_zeros.py). It asks its
`StepPrograms` (step_programs.py: compiling, warm-up, priming, the fused-step check) for
the program of each step; the programs' math is step_functions.py.

A step is a forward over T tokens and a head over R logits rows (two programs), or one
fused program where the step is a b-token, b-row decode step with a checked fused program
(`StepPrograms.fused`); a decode step for which the scheduler asked K decode steps per
dispatch (ScheduledBatch.decode_steps, only at a size `compiled_sizes` said has a ready
program) runs K such steps in one decode-steps program (`StepPrograms.decode_steps`), its
outputs every step's. Every row's numerics are independent of T and R.

Invariants:
- Steps call compiled executables, never `jax.jit` dispatch: a step cannot trace or
  compile; `bucket_for` picks only compiled buckets (`cache_miss_count` stays 0 after
  warm-up).
- `run()` never waits for the device: it returns device arrays. The next step reads
  the previous step's sampled ids from `prev_ids` on device (overlap scheduling:
  no host round trip between consecutive decode steps).
- The jitted functions are created per Runner (closures over this engine's config and
  shardings); nothing device-resident is cached at module level.
- `params` is the canonical pytree (what weight updates and memory release read and
  replace); assigning it re-derives the compute params, so the two never disagree. Each
  weight is held once where the plan allows: a canonical leaf the compute params hold only
  in a layout no step reads it from canonically (an all-native plan's layer matrices, held
  as the native kernel's panels) is not kept (`held_params`: what is); reading `params`
  rebuilds such leaves from their layout bit for bit, as new arrays with the leaf's
  sharding (the family's `params_to_hold` / `canonical_params`), so an update of some
  leaves gives the bits of a full update.
- LoRA (cfg.max_loras_per_batch > 0): the adapter buffers (`lora`, model/lora_layout.py,
  replicated) live beside the params and reach the programs as `compute_params["lora"]`;
  without LoRA that key is absent, so the programs are exactly those of an engine built
  before LoRA existed. Where the steps' LoRA form is the native kernel they include B's
  panel copies `<m>_bp`, written with `<m>_b` in every `write_lora`. Their shapes never
  change (`write_lora` copies into a slot), and memory release keeps them (they are
  small): a resumed engine has its adapters.
- An engine spanning hosts (multiserve/multihost/) has `mirror` set on its leader: every
  device operation after warm-up (a step, the step buffers, priming, a weight update) is
  handed to `mirror` as a `DeviceOp` (multihost/ops.py) BEFORE it runs here, so every
  follower runs the same operations with the same host inputs in the same order.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from multiserve.config import EngineConfig, ModelConfig
from multiserve.engine.base.buckets import smallest_fit
from multiserve.engine.base.dtype_choice import DtypeChoice
from multiserve.engine.base.lora_adapters import LoraAdapter
from multiserve.engine.device import huge_pages
from multiserve.engine.device.program_share import SHARE
from multiserve.engine.device.programs import ProgramKind, ProgramSet
from multiserve.engine.device.step_functions import StepFunctions
from multiserve.engine.device.step_programs import StepPrograms
from multiserve.engine.sampling import sampler as sampling
from multiserve.engine.sched.compiled_sizes import CompiledSizes
from multiserve.engine.step_inputs import sampling_batch as sampling_host
from multiserve.engine.step_inputs.program_inputs import sampling_inputs, step_inputs
from multiserve.engine.step_inputs.sampling_zeros import SamplingBatches
from multiserve.engine.step_inputs.token_arrays import StepArrays
from multiserve.model.families import family_for
from multiserve.model.invariance.calibration import calibrate
from multiserve.model.invariance.plan import Calibration, InvariancePlan
from multiserve.model.invariance.workload import workload_for
from multiserve.model.invariance.xla_options import step_options
from multiserve.model.layers.kv_pool import KVPool, make_kv_pool, pool_layout
from multiserve.model.layers.lora import native_lora
from multiserve.model.lora_layout import b_panels, lora_b_panel_shapes, lora_buffer_shapes
from multiserve.model.param_tree import get_leaf, with_leaves
from multiserve.model.sharding import kv_pool_sharding, make_mesh, shard_params
from multiserve.multihost import ops


def _placed_as(a: jax.Array, spec: jax.ShapeDtypeStruct) -> jax.Array:
    """`a` with `spec`'s sharding (a rebuilt canonical leaf may come with its layout's)."""
    return a if a.sharding == spec.sharding else jax.device_put(a, spec.sharding)


def cast_params(params: Any, dtype: Any) -> Any:
    """Host (numpy) params cast to the engine's compute dtype (norms included)."""
    return jax.tree.map(lambda a: np.asarray(a).astype(np.dtype(dtype), copy=False), params)


@dataclass
class StepOutput:
    """Device arrays of one launched step (host reads them later)."""

    # [max_rows] int32 (rows >= R are junk); [K, max_rows] when decode_steps K > 1 (every
    # step's, in order)
    next_ids: jax.Array
    sample: sampling.SampleOutput  # device arrays (leaves [K, ...] when K > 1)
    num_rows: int
    wants_logprobs: bool
    # routing replay (EngineConfig.enable_return_routed_experts, a MoE model): the expert
    # ids of every token row, [T, MoE layers, k] int32; None without the option
    routed_experts: jax.Array | None = None
    # decode steps the dispatch ran (EngineConfig.decode_steps_per_dispatch, or 1)
    decode_steps: int = 1


class Runner:
    def __init__(self, cfg: EngineConfig, model_cfg: ModelConfig, params_host: Any,
                 devices: Sequence[jax.Device], num_pages: int, dtype: Any,
                 dtype_choice: DtypeChoice | None = None,
                 on_calibrated: Callable[[Calibration], Calibration] | None = None) -> None:
        self.cfg = cfg
        # the leader of an engine spanning hosts: receives every device op (module doc)
        self.mirror: Callable[[ops.DeviceOp], None] | None = None
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
        self.num_pages = num_pages
        self.max_rows = max(cfg.precompile_bs_paddings)
        self.calibration = _calibrate(cfg, model_cfg, self.devices, dtype, self.max_rows)
        if on_calibrated is not None:  # a spanning engine: every host runs the leader's plan
            self.calibration = on_calibrated(self.calibration)
        self.plan: InvariancePlan = self.calibration.plan
        # get_internal_state()["determinism"]: made once (immutable, read by any thread)
        self.determinism: dict[str, Any] = self.calibration.summary()
        self._compute: Any = None
        self._held: Any = None  # params_to_hold's tree (None while released)
        self._param_specs: Any = None
        # the weights' last huge-page advice, written by its thread when done
        # (device/huge_pages.py)
        self.huge_page_advice: dict[str, huge_pages.HugePageAdvice] = {}
        self.huge_pages_thread: threading.Thread | None = None
        self.params = shard_params(cast_params(params_host, dtype), model_cfg, self.mesh,
                                   cfg.moe_sharding)
        # the pool in the layout the plan's attention kernel reads in place
        self.kv_layout = pool_layout(self.plan.attention.kernel)
        kv_sharding = kv_pool_sharding(model_cfg, self.mesh, self.kv_layout)
        # the LoRA adapter buffers (None: no LoRA), slot 0 all zeros
        self.lora: dict[str, jax.Array] | None = None
        if cfg.max_loras_per_batch > 0:
            if model_cfg.num_experts > 0:
                raise ValueError("max_loras_per_batch: LoRA adapters are supported on the "
                                 "dense families only, not on a mixture-of-experts model")
            shapes = lora_buffer_shapes(model_cfg, cfg.max_loras_per_batch + 1,
                                        cfg.max_lora_rank)
            self.lora = {k: jax.device_put(np.zeros(shape, np.float32 if k == "scale"
                                                    else np.dtype(dtype)), self.replicated)
                         for k, shape in shapes.items()}
            if native_lora(self.plan, self.lora):  # B's panel copies for the native kernel
                self.lora.update({k: jax.device_put(np.zeros(shape, np.dtype(dtype)),
                                                    self.replicated)
                                  for k, shape in lora_b_panel_shapes(
                                      model_cfg, cfg.max_loras_per_batch + 1,
                                      cfg.max_lora_rank).items()})
        self.kv: KVPool | None = make_kv_pool(model_cfg, num_pages, cfg.page_size, dtype,
                                              sharding=kv_sharding, layout=self.kv_layout)
        self._prev_ids: jax.Array | None = None
        self.reset_prev_ids()
        self._sampling = SamplingBatches(model_cfg.vocab_size, self.replicated)
        self.warmup_seconds: float | None = None  # warm-up start -> serving
        self.fused_steps = 0  # steps run as one fused program (get_internal_state)
        # dispatches that ran K decode steps (get_internal_state)
        self.decode_steps_dispatches = 0
        # routing replay: only an engine started with the option on a MoE model captures
        self.routed_experts = cfg.enable_return_routed_experts and bool(model_cfg.moe_layers)
        functions = StepFunctions(self.family, model_cfg, self.plan, cfg.page_size,
                                  cfg.attention_block_size, self.max_rows, self.replicated,
                                  kv_sharding, routed_experts=self.routed_experts)
        # the XLA options of every program (model/invariance/xla_options.py)
        xla_options = step_options(self.devices[0].platform, str(jnp.dtype(dtype)))
        self.step_programs = StepPrograms(cfg, functions, self.mesh, xla_options, dtype, self)

    # ---- params ---------------------------------------------------------------------
    @property
    def params(self) -> Any:
        """The canonical params pytree on the device (None while released): the held
        leaves, and those held only in a compute layout rebuilt (new arrays, each with its
        leaf's sharding; module doc). Read it for weight updates and read-backs, not per
        step."""
        if self._held is None:
            return None
        # the fleet's engines updating their weights at once rebuild with one program
        key = ("canonical_params", self.model_cfg, self.plan, str(jnp.dtype(self.dtype)),
               len(self.devices))
        with SHARE.first_alone(key, self.devices[0].platform):
            full = self.family.canonical_params(self._held, self._compute, self.model_cfg)
        return jax.tree.map(_placed_as, full, self._param_specs)

    @params.setter
    def params(self, value: Any) -> None:
        self._held = None
        self._compute = None  # drop the old layouts before making new ones
        if value is not None:
            self._param_specs = jax.tree.map(
                lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), value)
            self._compute = self.family.compute_params(value, self.model_cfg, self.plan,
                                                       self.cfg.precompile_token_paddings)
            # the leaves left out are freed with the caller's tree
            self._held = self.family.params_to_hold(value, self._compute)
            self.huge_pages_thread = huge_pages.in_background(
                self._compute, partial(self.huge_page_advice.__setitem__, "weights"))

    def param(self, path: tuple[str, ...]) -> jax.Array | None:
        """One canonical leaf by path (None while released): the held array, or that leaf
        alone rebuilt from its compute layout (`family.canonical_leaf`), with its sharding."""
        if self._held is None:
            return None
        leaf = self.family.canonical_leaf(self._held, self._compute, self.model_cfg, path)
        return _placed_as(leaf, get_leaf(self._param_specs, path))

    @property
    def held_params(self) -> Any:
        """The canonical leaves held as they are (the canonical pytree less the leaves
        held only in a compute layout; None while released). Nothing is rebuilt."""
        return self._held

    @property
    def param_specs(self) -> Any:
        """The canonical pytree's shape, dtype and sharding of every leaf (fixed at start;
        read while released too)."""
        return self._param_specs

    @property
    def compute_params(self) -> Any:
        """The params the step runs on: `params` plus their transposed copies and, with
        LoRA, the adapter buffers under "lora" (None while released). Every device array
        holding weights is a leaf of this pytree."""
        if self._compute is None or self.lora is None:
            return self._compute
        return {**self._compute, "lora": self.lora}

    @property
    def lora_enabled(self) -> bool:
        """The engine has LoRA buffers: its steps take each token's adapter slot."""
        return self.lora is not None

    @property
    def lora_kernel(self) -> str | None:
        """The form of the steps' LoRA delta (model/layers/lora.py `native_lora`): "native"
        or "xla"; None without LoRA buffers."""
        if self.lora is None:
            return None
        return "native" if native_lora(self.plan, self.lora) else "xla"

    def write_lora(self, slot: int, adapter: LoraAdapter | None) -> None:
        """Copy `adapter` into LoRA slot `slot` (None: zero the slot). Between steps,
        on the engine thread; a step already launched keeps the buffers it was given."""
        assert self.lora is not None and 0 < slot < self.lora["scale"].shape[0]
        new = dict(self.lora)
        for key, buf in self.lora.items():
            value: np.ndarray | np.float32
            if key == "scale":
                value = np.float32(adapter.scale if adapter is not None else 0.0)
            elif adapter is not None and key.endswith("_bp"):  # B's panel copy of `<m>_b`
                value = b_panels(adapter.buffers[key[:-1]].astype(buf.dtype))
            elif adapter is not None:
                value = adapter.buffers[key].astype(buf.dtype)
            else:
                value = np.zeros(buf.shape[:1] + buf.shape[2:], buf.dtype)
            updated = buf.at[slot].set(value) if key == "scale" else buf.at[:, slot].set(value)
            new[key] = jax.device_put(updated, self.replicated)
        self.lora = new

    @property
    def prev_ids(self) -> jax.Array | None:
        """The last step's sampled ids on device, [max_rows] (None while released)."""
        return self._prev_ids

    @property
    def resident(self) -> bool:
        """Weights, KV pool and step buffers are on the device (memory not released)."""
        return self._compute is not None and self.kv is not None and self._prev_ids is not None

    @property
    def programs(self) -> ProgramSet:
        """The compiled programs' set: readiness, status, background compiles (read by the
        engine and its reports)."""
        return self.step_programs.set

    # ---- what a step needs -----------------------------------------------------------
    def bucket_for(self, num_tokens: int, num_rows: int) -> tuple[int, int]:
        """The smallest compiled (T, R) buckets holding the step (all configured buckets
        when warm-up is off: those compile on first use)."""
        programs = self.step_programs
        t = smallest_fit(programs.compiled_buckets(ProgramKind.FORWARD), num_tokens)
        r = smallest_fit(programs.compiled_buckets(ProgramKind.HEAD), num_rows)
        if t is None or r is None:
            raise ValueError(f"no bucket for {num_tokens} tokens / {num_rows} rows")
        return t, r

    def compiled_sizes(self) -> CompiledSizes:
        """The sizes of the programs a step may run now, for the scheduler to tell which
        decode steps run `decode_steps_per_dispatch` steps in one dispatch
        (engine/sched/compiled_sizes.py): `bucket_for`'s token and row buckets, and the
        sizes with a ready decode-steps program (none in an engine spanning hosts, whose
        followers replay single steps)."""
        programs = self.step_programs
        ready = (() if self.mirror is not None or not programs.decode_steps_sizes
                 else programs.set.ready(ProgramKind.DECODE_STEPS))
        return CompiledSizes(tuple(programs.compiled_buckets(ProgramKind.FORWARD)),
                             tuple(programs.compiled_buckets(ProgramKind.HEAD)), ready)

    def page_table_rows(self, num_tokens: int) -> int:
        """Sequence rows of a T-token step: every row has a token, and at most max_rows."""
        return min(num_tokens, self.max_rows)

    def sampling_batch(self, rows: Sequence[sampling_host.RowSpec | None],
                       num_rows: int) -> sampling.SamplingBatch:
        """Host sampling inputs for one step of `num_rows` logits rows (padded to the
        sampler's rows); penalty-free steps reuse this engine's device-resident zeros."""
        return self._sampling.build(rows, num_rows)

    def sampling_zeros(self, num_rows: int) -> tuple[Any, Any, Any]:
        """The device zeros a penalty-free, mask-free step of `num_rows` rows samples
        with: (output counts, prompt mask, token mask)."""
        penalties, masks = self._sampling.zeros(num_rows)
        return penalties.output_counts, penalties.prompt_mask, masks

    # ---- running -------------------------------------------------------------------
    def run(self, arrays: StepArrays, sb_host: sampling.SamplingBatch, wants_logprobs: bool,
            num_rows: int, decode_steps: int = 1) -> StepOutput:
        """Launch one step: `num_rows` (a row bucket) logits rows, sampled with `sb_host`
        (built by `sampling_batch(specs, num_rows)`): one fused program where it has one
        (`StepPrograms.fused`), else the forward and the head. `decode_steps` K > 1 (a
        decode-only step of a size `compiled_sizes` gave the scheduler): its decode-steps
        program, K decode steps from this one."""
        assert self.kv is not None, "KV pool released: resume memory before running"
        assert self._prev_ids is not None, "step buffers released: resume memory first"
        packed, sampling_args = step_inputs(arrays), sampling_inputs(sb_host)
        tokens = arrays.input_ids.shape[0]
        if decode_steps > 1:
            return self._run_decode_steps(tokens, num_rows, wants_logprobs, packed,
                                          sampling_args, decode_steps)
        if self.mirror is not None:
            self.mirror(ops.RunStep(tokens, num_rows, wants_logprobs, packed,
                                    sampling_args[0],
                                    *(ops.host_or_none(a) for a in sampling_args[1:])))
        programs = self.step_programs
        return self._launch(tokens, num_rows, wants_logprobs, packed, sampling_args,
                            lambda inputs: programs.forward(arrays, inputs),
                            lambda inputs: programs.head(num_rows, sb_host, inputs))

    def run_packed(self, tokens: int, packed: np.ndarray, sampling_args: tuple[Any, ...],
                   wants_logprobs: bool, num_rows: int) -> StepOutput:
        """`run` from its packed host inputs (step_inputs/program_inputs.py), on the
        programs `run` chose for the same buckets: how a follower of a spanning engine
        runs the leader's step (multihost/ops.py). Only compiled programs (a spanning
        engine warms up fully)."""
        programs = self.step_programs

        def compiled(kind: ProgramKind, size: int) -> Any:
            program = programs.set.get(kind, size)
            assert program is not None, (kind, size)
            return program

        return self._launch(tokens, num_rows, wants_logprobs, packed, sampling_args,
                            lambda _: compiled(ProgramKind.FORWARD, tokens),
                            lambda _: compiled(ProgramKind.HEAD, num_rows))

    def _launch(self, tokens: int, num_rows: int, wants_logprobs: bool, packed: np.ndarray,
                sampling_args: tuple[Any, ...], forward_for: Callable[[tuple[Any, ...]], Any],
                head_for: Callable[[tuple[Any, ...]], Any]) -> StepOutput:
        """Run a step of buckets (`tokens`, `num_rows`) on its packed inputs: the fused
        program where one is ready, else the forward then the head, each from
        `forward_for` / `head_for` (given the program's arguments)."""
        assert self.kv is not None and self._prev_ids is not None  # (checked by `run`)
        fused = self.step_programs.fused(tokens, num_rows)
        if fused is not None:
            next_ids, out, self.kv, *experts = fused(
                self.compute_params, self.kv, self._prev_ids, packed, *sampling_args)
            self.fused_steps += 1
        else:
            inputs = (self.compute_params, self.kv, self._prev_ids, packed)
            hidden, row_tok, row_prev, self.kv, *experts = forward_for(inputs)(*inputs)
            head_inputs = (self.compute_params, hidden, row_tok, row_prev, *sampling_args)
            next_ids, out = head_for(head_inputs)(*head_inputs)
        self._prev_ids = next_ids
        return StepOutput(next_ids=next_ids, sample=out, num_rows=num_rows,
                          wants_logprobs=wants_logprobs,
                          routed_experts=experts[0] if experts else None)

    def _run_decode_steps(self, tokens: int, num_rows: int, wants_logprobs: bool,
                          packed: np.ndarray, sampling_args: tuple[Any, ...],
                          decode_steps: int) -> StepOutput:
        """Run a decode step's decode-steps program (`compiled_sizes` said it is ready)."""
        program = self.step_programs.decode_steps(tokens, num_rows)
        assert program is not None and decode_steps == self.cfg.decode_steps_per_dispatch, \
            (tokens, num_rows, decode_steps)
        assert self.mirror is None, "a spanning engine's followers replay single steps"
        assert self.kv is not None and self._prev_ids is not None  # (checked by `run`)
        self._prev_ids, ids, out, self.kv = program(self.compute_params, self.kv,
                                                    self._prev_ids, packed, *sampling_args)
        self.decode_steps_dispatches += 1
        return StepOutput(next_ids=ids, sample=out, num_rows=num_rows,
                          wants_logprobs=wants_logprobs, decode_steps=decode_steps)

    # ---- memory release (engine/rl/memory.py) ----------------------------------------
    def reset_prev_ids(self) -> None:
        if self.mirror is not None:
            self.mirror(ops.ResetPrevIds())
        self._prev_ids = jax.device_put(np.zeros(self.max_rows, np.int32), self.replicated)

    def drop_step_buffers(self) -> None:
        """Free the small per-step device buffers (memory release: engine/rl/memory.py).
        `reset_prev_ids()` brings back the only one a step needs; the sampler's zeros are
        re-made lazily."""
        if self.mirror is not None:
            self.mirror(ops.DropStepBuffers())
        prev, self._prev_ids = self._prev_ids, None
        if prev is not None and not prev.is_deleted():
            prev.delete()
        self._sampling.drop()

    def prime_deferred(self) -> None:
        """Memory is resident again: prime (and check) the programs that arrived while it
        was released (StepPrograms.prime_deferred). Between steps, on the engine thread."""
        if self.mirror is not None:
            self.mirror(ops.PrimeDeferred())
        self.step_programs.prime_deferred()

    def replace_leaves(self, leaves: dict[tuple[str, ...], np.ndarray]) -> None:
        """A weight update from host values: each leaf at its path placed with the sharding
        of the leaf it replaces, then the params swapped and the replaced leaves freed.
        Between steps, on the engine thread: how an engine spanning hosts updates weights
        (every host places its own shards of the same host values)."""
        if self.mirror is not None:
            self.mirror(ops.SetParams(leaves))
        live = self.params
        assert live is not None, "weights released"
        new, replaced = with_leaves(live, leaves, lambda path, old: jax.device_put(
            np.asarray(leaves[path], old.dtype), old.sharding))
        self.params = new
        for a in replaced:
            a.delete()


def _calibrate(cfg: EngineConfig, model_cfg: ModelConfig, devices: Sequence[jax.Device],
               dtype: Any, max_rows: int) -> Calibration:
    """An engine's invariance plan: pinned by the config, else measured on its first
    device's backend for exactly its shapes and buckets (model/invariance/calibration.py;
    cached, so a second start, or a second engine of the same kind, probes nothing)."""
    if cfg.invariance_plan is not None:
        return Calibration(cfg.invariance_plan, {"pinned": True}, "pinned", 0.0, False)
    workload = workload_for(model_cfg, cfg.precompile_token_paddings,
                            cfg.precompile_bs_paddings, max_rows, cfg.page_size,
                            cfg.attention_block_size, dtype, tp=len(devices),
                            moe_sharding=cfg.moe_sharding)
    return calibrate(workload, devices[0])
