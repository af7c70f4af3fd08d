"""Test helpers for tests/model: tiny configs and a small paged-KV simulator that builds
ragged ForwardBatches (any mix of prefill chunks and decode tokens, any row order, padded
to chosen bucket sizes) and runs the model forward on them."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from multiserve.config import ModelConfig
from multiserve.model.invariance.calibration import default_plan
from multiserve.model.families import family_for
from multiserve.model.families.forward import forward
from multiserve.model.layers.forward_batch import ForwardBatch
from multiserve.model.layers.kv_pool import make_kv_pool, pool_layout
from multiserve.model.invariance.primitives import is_compute_params
from multiserve.model.invariance.xla_options import step_options

_FORWARDS: dict[str, Any] = {}


def forward_program(dtype: Any) -> Any:
    """The jitted forward for `dtype` weights, compiled with the XLA options of the engine's
    step programs of that dtype on this backend (xla_options.step_options): one per dtype
    for all simulators (any family), so their compile caches are shared."""
    name = str(jnp.dtype(dtype))
    if name not in _FORWARDS:
        _FORWARDS[name] = jax.jit(
            forward, static_argnames=("cfg", "page_size", "attn_block_size", "plan", "tp"),
            donate_argnums=(1,),
            compiler_options=step_options(jax.devices()[0].platform, name))
    return _FORWARDS[name]


def layer_matrix_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of every layer matrix: the contractions `dense` computes per layer."""
    d, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    i = cfg.intermediate_size
    return {"wq": (d, q), "wk": (d, kv), "wv": (d, kv), "wo": (q, d), "w_gate": (d, i),
            "w_up": (d, i), "w_down": (i, d)}


def head_shape(cfg: ModelConfig) -> tuple[int, int]:
    """(in, out) of the output head."""
    return cfg.hidden_size, cfg.vocab_size


def products_on(plan: Any, kernel: str) -> Any:
    """`plan` with every product on formulation `kernel` at each row count's own size."""
    from dataclasses import replace

    from multiserve.model.invariance.plan import Formulation

    return replace(plan, products=tuple(
        replace(p, by_rows=tuple((m, Formulation(kernel, m)) for m, _ in p.by_rows))
        for p in plan.products))


TINY_LLAMA = ModelConfig(
    architecture="llama", vocab_size=256, hidden_size=64, intermediate_size=128,
    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0,
    rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_ids=(2,))


def every_layout(params: Any, cfg: ModelConfig) -> Any:
    """Canonical `params` in the compute form with every layout (plan None): what a
    PagedSim runs, whatever plan it is given. Pass it to several simulators of the same
    weights to make it once (~3x the weights' bytes each time)."""
    return family_for(cfg).compute_params(params, cfg, None, ())


@dataclass
class Seq:
    tokens: list[int]
    pages: list[int] = field(default_factory=list)
    kv_len: int = 0  # tokens whose K/V are in the pool


class PagedSim:
    """Owns a KV pool and sequences; `step` runs one forward over the given new tokens."""

    def __init__(self, params: Any, cfg: ModelConfig, *, page_size: int, block_size: int,
                 num_pages: int = 512, max_pages: int = 64, seed: int = 0,
                 kv_sharding: Any = None, plan: Any = None, tp: Any = None) -> None:
        self.params = params if is_compute_params(params) else every_layout(params, cfg)
        self.cfg = cfg
        self.ps, self.bs, self.max_pages = page_size, block_size, max_pages
        dtype = self.params["embed"].dtype
        # the plan of a default engine on this machine, unless the test gives one
        self.plan = plan if plan is not None else default_plan(
            cfg, dtype, page_size=page_size, block_size=block_size)
        # the pool in the layout the plan's attention kernel reads (kv_pool.py)
        self.kv = make_kv_pool(cfg, num_pages, page_size, dtype, sharding=kv_sharding,
                               layout=pool_layout(self.plan.attention.kernel))
        rng = np.random.default_rng(seed)
        self.free = [int(p) for p in rng.permutation(np.arange(1, num_pages))]  # not page 0
        self.seqs: dict[str, Seq] = {}
        self.fwd = partial(forward_program(dtype), cfg=cfg, page_size=page_size,
                           attn_block_size=block_size, plan=self.plan, tp=tp)

    def add(self, name: str, tokens: list[int]) -> None:
        self.seqs[name] = Seq(list(tokens))

    def fork(self) -> "PagedSim":
        """A simulator in this one's state (its sequences, free pages and a copy of its KV
        pool: steps donate the pool), stepping on independently from here."""
        import copy

        twin = copy.copy(self)
        twin.seqs = copy.deepcopy(self.seqs)
        twin.free = list(self.free)
        twin.kv = jax.tree.map(jnp.copy, self.kv)
        return twin

    def step(self, work: list[tuple[str, int]], *, T: int = 64, B: int = 64, R: int = 64,
             rows: np.random.Generator | None = None, seq_rows: dict[str, int] | None = None,
             logits_for: dict[str, list[int]] | None = None) -> dict[tuple[str, int], np.ndarray]:
        """Run the next `n` tokens of each (name, n) in `work` in one forward.

        `rows` shuffles token rows; `seq_rows` fixes each sequence's page-table row;
        `logits_for[name]` lists the positions whose logits to return (default: the last new
        token of each work item). Returns {(name, position): logits row}.
        """
        ids, pos, tseq, slots, want = [], [], [], [], []
        table = np.zeros((B, self.max_pages), np.int32)
        lens = np.zeros(B, np.int32)
        seq_rows = dict(seq_rows or {})
        free_rows = [r for r in range(B) if r not in seq_rows.values()]
        for name, n in work:
            s = self.seqs[name]
            row = seq_rows.setdefault(name, free_rows.pop(0))
            new_len = s.kv_len + n
            while len(s.pages) * self.ps < new_len:
                s.pages.append(self.free.pop())
            table[row, :len(s.pages)] = s.pages
            lens[row] = new_len
            wanted = (logits_for or {}).get(name, [new_len - 1])
            for p in range(s.kv_len, new_len):
                ids.append(s.tokens[p])
                pos.append(p)
                tseq.append(row)
                slots.append(s.pages[p // self.ps] * self.ps + p % self.ps)
                want.append((name, p) if p in wanted else None)
            s.kv_len = new_len
        n_real = len(ids)
        assert n_real <= T, (n_real, T)
        order = rows.permutation(T) if rows is not None else np.arange(T)  # row of item i
        arr = {k: np.zeros(T, np.int32) for k in ("ids", "pos", "tseq", "slots")}
        logit_rows = np.zeros(R, np.int32)
        keys: list[tuple[str, int]] = []
        for i in range(n_real):
            r = order[i]
            arr["ids"][r], arr["pos"][r], arr["tseq"][r], arr["slots"][r] = (
                ids[i], pos[i], tseq[i], slots[i])
            if want[i] is not None:
                logit_rows[len(keys)] = r
                keys.append(want[i])
        assert len(keys) <= R
        batch = ForwardBatch(
            input_ids=jnp.asarray(arr["ids"]), positions=jnp.asarray(arr["pos"]),
            token_seq=jnp.asarray(arr["tseq"]), out_slots=jnp.asarray(arr["slots"]),
            page_table=jnp.asarray(table), seq_lens=jnp.asarray(lens),
            logit_rows=jnp.asarray(logit_rows))
        logits, self.kv = self.fwd(self.params, self.kv, batch)
        logits = np.asarray(logits)
        return {k: logits[i] for i, k in enumerate(keys)}
