"""The math of one engine's step: the traced functions its programs are lowered from.

The programs' functions (step_programs.py compiles them, runner.py runs them):
- `forward` (`_forward_impl`) over T tokens: the decoder (the model's family,
  model/families); it returns the final-normed hidden states of the logits rows in a fixed
  [max_rows, D] buffer, the rows' input ids and whether each came from the previous step;
- the head over R rows, two programs: `logits` (`_logits_impl`: lm_head on the first R
  rows, float32, padded to the sampler's rows, `sampler_rows`) then `sample`
  (`_sample_impl`: the sampler over those rows, which depends on nothing else but the
  vocabulary and max_rows);
- `step` (`_step_impl`): the forward, logits and sampler of a b-token, b-row step in ONE
  program, each boundary's arrays constrained to the sharding the separate programs pass
  them in: the same computation as the three;
- `decode_steps` (`_multi_impl`): K (EngineConfig.decode_steps_per_dispatch) decode steps
  of b rows in ONE program, a `lax.scan` whose every step is `step`'s computation
  (`_step_arrays`) on the step arrays advanced on the device (`advance_step`: positions and
  sequence lengths + 1 a step, each K/V slot read from the row's page-table row, the input
  id the step before sampled) and the sampler's position + 1 a step, so each step draws
  what a single step at that position draws. Never with routing replay.
With `routed_experts` (an engine started with enable_return_routed_experts on a MoE
model), `forward` and `step` return one more output, last: the top-k expert ids of every
token row in every MoE layer, [T, MoE layers, k] int32 (routing replay,
engine/base/routed_experts.py). Without it they are exactly the programs of an engine that has
no such option (the same lowered modules, hence the same persistent-cache keys).

Invariants:
- The traced functions' names are the lowered modules' names (`jit__forward_impl`, ...),
  which the persistent compilation cache keys and program_share.py's HLO hash include:
  renaming one misses every cached program.
- A program's small host inputs travel as ONE packed int32 array (engine/step_inputs/packed.py),
  unpacked here with the static `layout` of its bucket.
- The jitted functions are made per engine (closures over its config and shardings);
  nothing device-resident is held here.
- Every row's numerics are independent of T and R (model/invariance/primitives.py, attention.py, and
  the sampler's fixed-size row chunks), and of the collectives of a tensor-parallel
  engine: no program sums a float across devices (model/tensor_parallel.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, cast

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from multiserve.config import ModelConfig
from multiserve.engine.sampling import sampler as sampling
from multiserve.engine.step_inputs.packed import Layout, unpack
from multiserve.engine.step_inputs.sampling_zeros import sampler_rows
from multiserve.model.families.base import ModelFamily
from multiserve.model.invariance.plan import InvariancePlan
from multiserve.model.layers.forward_batch import ForwardBatch
from multiserve.model.layers.kv_pool import KVPool, pool_layout
from multiserve.model.tensor_parallel import TensorParallel


class StepFunctions:
    """The jitted step functions of one engine (`forward`, `logits`, `sample`, `step`),
    lowered by step_programs.StepPrograms, never called through jit dispatch."""

    def __init__(self, family: ModelFamily, model_cfg: ModelConfig, plan: InvariancePlan,
                 page_size: int, attention_block_size: int, max_rows: int,
                 replicated: NamedSharding, kv_sharding: NamedSharding,
                 routed_experts: bool = False) -> None:
        self.family = family
        self.routed_experts = routed_experts
        routed_out = (replicated,) if routed_experts else ()
        self.model_cfg = model_cfg
        self.plan = plan
        self.page_size = page_size
        self.attention_block_size = attention_block_size
        self.max_rows = max_rows
        self.replicated = replicated
        # several devices: the forward sums no float across them (model/tensor_parallel.py)
        self.tp = TensorParallel.of(cast(Mesh, replicated.mesh), model_cfg)
        # the pool's output shardings: a KVPool whose leaves are shardings
        kv_out = KVPool(k=kv_sharding, v=kv_sharding,  # type: ignore[arg-type]
                        layout=pool_layout(plan.attention.kernel))
        # explicit output shardings: warm-up lowers the heads from abstract inputs that
        # must match what a forward really returns
        self.forward = jax.jit(
            self._forward_impl, donate_argnums=(1,), static_argnames=("layout",),
            out_shardings=(replicated, replicated, replicated, kv_out, *routed_out))
        # replicated logits: the sampler program runs whole on every device (a tensor-
        # parallel lm_head's vocabulary-split logits are gathered here)
        self.logits = jax.jit(self._logits_impl, static_argnames=("num_rows",),
                              out_shardings=(replicated,) * 3)
        self.sample = jax.jit(_sample_impl, static_argnames=("layout", "max_rows"))
        self.step = jax.jit(
            self._step_impl, donate_argnums=(1,),
            static_argnames=("layout", "sample_layout", "num_rows"),
            out_shardings=(replicated, replicated, kv_out, *routed_out))
        # K decode steps in one program (no routing replay: `_multi_impl`, a name kept as
        # its lowered module's: the persistent compilation cache's keys)
        self.decode_steps = jax.jit(
            self._multi_impl, donate_argnums=(1,),
            static_argnames=("layout", "sample_layout", "num_rows", "decode_steps"),
            out_shardings=(replicated, replicated, replicated, kv_out))

    def _forward_impl(self, params: Any, kv: KVPool, prev_ids: jax.Array, packed: jax.Array,
                      *, layout: Layout) -> tuple[Any, ...]:
        """(hidden [max_rows, D], row ids, rows from the previous step, kv[, expert ids
        [T, MoE layers, k] with `routed_experts`])."""
        return self._forward_arrays(params, kv, prev_ids, unpack(packed, layout))

    def _forward_arrays(self, params: Any, kv: KVPool, prev_ids: jax.Array,
                        arrays: dict[str, jax.Array]) -> tuple[Any, ...]:
        """`_forward_impl` on the step arrays unpacked."""
        from_prev = arrays["from_prev"]
        ids = jnp.where(from_prev >= 0, prev_ids[jnp.maximum(from_prev, 0)],
                        arrays["input_ids"])
        fb = ForwardBatch(input_ids=ids, positions=arrays["positions"],
                          token_seq=arrays["token_seq"], out_slots=arrays["out_slots"],
                          page_table=arrays["page_table"], seq_lens=arrays["seq_lens"],
                          logit_rows=arrays["logit_rows"],
                          lora_slots=arrays.get("lora_slots"))
        rows = arrays["logit_rows"]
        if self.routed_experts:
            hidden, kv, experts = self.family.forward_hidden_routed(
                params, kv, fb, self.model_cfg, page_size=self.page_size,
                attn_block_size=self.attention_block_size, plan=self.plan, tp=self.tp)
            return hidden, ids[rows], from_prev[rows] >= 0, kv, experts
        hidden, kv = self.family.forward_hidden(
            params, kv, fb, self.model_cfg, page_size=self.page_size,
            attn_block_size=self.attention_block_size, plan=self.plan, tp=self.tp)
        return hidden, ids[rows], from_prev[rows] >= 0, kv

    def _logits_impl(self, params: Any, hidden: jax.Array, row_tok: jax.Array,
                     row_prev: jax.Array, *, num_rows: int
                     ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The head's first program: float32 logits of the first `num_rows` rows, padded
        with zero rows to the sampler's rows (`sampler_rows`), and the rows' unread-token
        inputs padded alike (padding rows: greedy, mask False)."""
        logits = self.family.lm_head(params, hidden[:num_rows], self.plan, self.model_cfg)
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
                   num_rows: int) -> tuple[Any, ...]:
        """A fused step: `_forward_impl`, `_logits_impl` and `_sample_impl` in one program,
        each boundary's arrays constrained to the sharding the two programs pass them in
        (so a tensor-parallel head's logits are gathered before the sampler, as there)."""
        return self._step_arrays(params, kv, prev_ids, unpack(packed, layout),
                                 lambda: unpack(packed_sb, sample_layout), output_counts,
                                 prompt_mask, token_mask, num_rows)

    def _step_arrays(self, params: Any, kv: KVPool, prev_ids: jax.Array,
                     arrays: dict[str, jax.Array],
                     small_sb: Callable[[], sampling.SamplingBatch],
                     output_counts: jax.Array, prompt_mask: jax.Array,
                     token_mask: jax.Array, num_rows: int) -> tuple[Any, ...]:
        """`_step_impl` on its step arrays unpacked; `small_sb()` gives the sampler's small
        fields, traced where the sampler starts: the fused step's module keeps its op
        order, which its persistent-cache key (a hash of the module's text) depends on."""
        def replicated(*xs: jax.Array) -> tuple[jax.Array, ...]:
            return tuple(jax.lax.with_sharding_constraint(x, self.replicated) for x in xs)

        hidden, row_tok, row_prev, kv, *experts = self._forward_arrays(
            params, kv, prev_ids, arrays)
        logits, tok, prev = replicated(*self._logits_impl(
            params, *replicated(hidden, row_tok, row_prev), num_rows=num_rows))
        next_ids, out = _sample_fields(logits, tok, prev, small_sb(), output_counts,
                                       prompt_mask, token_mask, max_rows=self.max_rows)
        return (next_ids, out, kv, *experts)

    def _multi_impl(self, params: Any, kv: KVPool, prev_ids: jax.Array, packed: jax.Array,
                    packed_sb: jax.Array, output_counts: jax.Array, prompt_mask: jax.Array,
                    token_mask: jax.Array, *, layout: Layout, sample_layout: Layout,
                    num_rows: int, decode_steps: int) -> tuple[Any, ...]:
        """`decode_steps` (K) decode steps in one program: a loop whose step k runs
        `_step_arrays`, the fused step's computation, on step 0 advanced by k positions
        (`advance_step`), reading the ids step k - 1 sampled; the sampler keyed by each
        step's position. Returns (the last step's ids [max_rows], every step's ids
        [K, max_rows], every step's SampleOutput (leaves [K, ...]), kv).
        Only for a decode-only step without routing replay: token row b is batch row b,
        logits row b, sequence row b (one_token_rows)."""
        arrays = unpack(packed, layout)
        small_sb = unpack(packed_sb, sample_layout)

        def decode_step(carry: tuple[KVPool, jax.Array], k: jax.Array
                        ) -> tuple[tuple[KVPool, jax.Array], tuple[jax.Array, Any]]:
            kv, prev = carry
            next_ids, out, kv = self._step_arrays(
                params, kv, prev, advance_step(arrays, k, self.page_size),
                lambda: dataclasses.replace(small_sb, position=small_sb.position + k),
                output_counts, prompt_mask, token_mask, num_rows)
            return (kv, next_ids), (next_ids, out)

        (kv, last), (ids, outs) = jax.lax.scan(decode_step, (kv, prev_ids),
                                               jnp.arange(decode_steps, dtype=jnp.int32))
        return last, ids, outs, kv


def advance_step(arrays: dict[str, jax.Array], k: jax.Array,
                 page_size: int) -> dict[str, jax.Array]:
    """The step arrays of a decode-only step advanced by `k` decode steps (traced): each
    real row (seq_len > 0) one position on per step, its input the id the step before
    sampled into its own row of the previous ids (from step 1 on), its K/V slot read from its
    page-table row; padding rows as they were. At k = 0 the arrays unchanged: what
    step_inputs/token_arrays.py one_token_rows writes for the step K single steps would run k steps
    later, with every row's pages already in its table."""
    seq_lens, page_table = arrays["seq_lens"], arrays["page_table"]
    tokens = arrays["positions"].shape[0]
    assert seq_lens.shape[0] == tokens, "a decode-only step: one sequence row per token"
    real = seq_lens > 0
    positions = jnp.where(real, arrays["positions"] + k, arrays["positions"])
    rows = jnp.arange(tokens, dtype=jnp.int32)
    pages = page_table[rows, positions // page_size]
    slots = jnp.where(real, pages * page_size + positions % page_size, arrays["out_slots"])
    from_prev = jnp.where(k > 0, jnp.where(real, rows, -1), arrays["from_prev"])
    return {**arrays, "positions": positions, "out_slots": slots, "from_prev": from_prev,
            "seq_lens": jnp.where(real, seq_lens + k, seq_lens)}


def _sample_impl(logits: jax.Array, tok: jax.Array, prev: jax.Array, packed: jax.Array,
                 output_counts: jax.Array, prompt_mask: jax.Array, token_mask: jax.Array, *,
                 layout: Layout, max_rows: int) -> tuple[jax.Array, Any]:
    """The head's second program: the sampler over the padded rows, and the sampled ids in
    the [max_rows] buffer the next forward reads (rows past the step's are padding).
    Penalties count output tokens; the host does not know the ids still on device: the
    sampler counts them for rows whose input came from the previous step (only when some
    row has a penalty: no [R, V] array is touched otherwise)."""
    return _sample_fields(logits, tok, prev, unpack(packed, layout), output_counts,
                          prompt_mask, token_mask, max_rows=max_rows)


def _sample_fields(logits: jax.Array, tok: jax.Array, prev: jax.Array,
                   small_sb: sampling.SamplingBatch, output_counts: jax.Array,
                   prompt_mask: jax.Array, token_mask: jax.Array, *,
                   max_rows: int) -> tuple[jax.Array, Any]:
    """`_sample_impl` on the sampler's small fields unpacked."""
    sb = dataclasses.replace(small_sb, output_counts=output_counts, prompt_mask=prompt_mask,
                             token_mask=token_mask, unread_token=tok, has_unread=prev)
    out = sampling.sample(logits, sb)
    rows = min(logits.shape[0], max_rows)
    next_ids = jnp.zeros(max_rows, jnp.int32).at[:rows].set(out.next_ids[:rows])
    return next_ids, out
