"""What the calibration probes: every primitive size an engine will run (`Workload`), built
from a model config, the engine's buckets and its tensor-parallel degree through the family
interface (`workload_for`, `default_workload`).

A workload is plain data (no jax): its fields, as `dataclasses.asdict` writes them, are part
of the plan's cache key (store.backend_key), and a probe's `repr` seeds its random data
(probes.probe_rng), so renaming a field or a class changes every key.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class ProductUse:
    name: str  # layer matrix name or "head"
    k: int  # global contraction shape (what the model traces)
    n: int
    local_k: int  # the shape one device computes (tensor parallelism splits one side)
    local_n: int
    sizes: tuple[int, ...]  # row counts the engine runs
    sharded: bool = False  # the engine is tensor-parallel (GSPMD-partitioned operands)


@dataclass(frozen=True)
class AttentionUse:
    kv_heads: int  # per device
    group: int
    head_dim: int
    page_size: int
    block_size: int
    sizes: tuple[int, ...]  # token counts the engine runs
    sharded: bool = False  # heads split over a tensor-parallel group (GSPMD-partitioned)
    # the attention terms of the model's layers beyond plain causal attention
    # (layers/attention_terms.py), each kind once: (sliding window or 0, sinks); () for a
    # model whose every layer is plain. A candidate is checked on every kind.
    kinds: tuple[tuple[int, bool], ...] = ()
    softcap: float = 0.0  # every layer's score soft cap (0: none)

    @property
    def plain(self) -> bool:
        """Every layer computes plain causal attention (what every kernel computes)."""
        return not self.kinds and self.softcap <= 0


@dataclass(frozen=True)
class GroupedUse:
    """A grouped (mixture-of-experts) product: rows x[m] @ W[expert of m], `experts`
    matrices of (local) shape local_k x local_n, at every routed-pair count in `sizes`
    (tokens x top-k)."""

    name: str
    k: int
    n: int
    local_k: int
    local_n: int
    experts: int
    sizes: tuple[int, ...]
    sharded: bool = False


@dataclass(frozen=True)
class Workload:
    """Every primitive size an engine will run: the input of the calibration."""

    dtype: str
    products: tuple[ProductUse, ...]
    row_sums: tuple[tuple[int, tuple[int, ...]], ...]  # (width, row counts)
    attention: AttentionUse
    grouped: tuple[GroupedUse, ...] = ()  # a MoE family's expert products


def workload_for(cfg: Any, token_sizes: Sequence[int], row_sizes: Sequence[int],
                 max_rows: int, page_size: int, block_size: int, dtype: Any,
                 tp: int = 1, moe_sharding: str = "tensor",
                 engine_defaults: bool = True) -> Workload:
    """The workload of an engine: model config `cfg` (ModelConfig), its step buckets and
    its tensor-parallel degree (the family's rules, model/families, decide which side of
    each matrix a device holds, and which products it runs: `product_shapes`, and for a
    MoE family the grouped expert products `grouped_shapes`).

    The sizes always include the default EngineConfig's buckets: engines of one model with
    other buckets (a fleet's per-engine overrides, tests, reference loops) then calibrate
    the same workload and share one plan, hence one reference and the same bits.
    `engine_defaults=False` leaves them out (a probe of exactly the given sizes: tests of
    the calibration itself)."""
    from multiserve.config import EngineConfig
    from multiserve.model.families import family_for
    from multiserve.model.tp_splits import tp_splits

    default = EngineConfig()
    extra_tokens = default.precompile_token_paddings if engine_defaults else ()
    extra_rows = default.precompile_bs_paddings if engine_defaults else ()
    tokens = tuple(sorted(set(token_sizes) | set(extra_tokens)))
    rows = tuple(sorted(set(row_sizes) | set(extra_rows) | {max_rows}))
    attn = tp_splits(cfg, tp)["attention"]
    family = family_for(cfg)

    def local(k: int, n: int, split: str) -> tuple[int, int]:
        return (k // tp if split == "in" else k), (n // tp if split == "out" else n)

    products = [ProductUse(p.name, p.k, p.n, *local(p.k, p.n, p.split),
                           rows if p.rows == "rows" else tokens, sharded=tp > 1)
                for p in family.product_shapes(cfg, tp, moe_sharding)]
    pairs = tuple(t * cfg.num_experts_per_tok for t in tokens)
    grouped = tuple(GroupedUse(g.name, g.k, g.n, *local(g.k, g.n, g.split), cfg.num_experts,
                               pairs, sharded=tp > 1)
                    for g in family.grouped_shapes(cfg, tp, moe_sharding))
    heads = cfg.num_heads // tp if attn else cfg.num_heads
    kv_heads = cfg.num_kv_heads // tp if attn else cfg.num_kv_heads
    kinds = tuple(sorted({(cfg.layer_window(i), cfg.attention_sinks)
                          for i in range(cfg.num_layers)}))
    row_sums = [(cfg.hidden_size, tuple(sorted(set(tokens) | set(rows))))]
    if cfg.qk_norm:
        row_sums.append((cfg.head_dim, tuple(sorted({t * h for t in tokens
                                                      for h in (heads, kv_heads)}))))
    return Workload(dtype=str(np.dtype(dtype)), products=tuple(products),
                    row_sums=tuple(row_sums),
                    attention=AttentionUse(kv_heads, cfg.num_heads // cfg.num_kv_heads,
                                           cfg.head_dim, page_size, block_size, tokens,
                                           sharded=attn,
                                           kinds=() if kinds == ((0, False),) else kinds,
                                           softcap=cfg.attn_logit_softcapping),
                    grouped=grouped)


def default_workload(cfg: Any, dtype: Any = np.float32, *, page_size: int | None = None,
                     block_size: int | None = None, tp: int = 1,
                     moe_sharding: str = "tensor") -> Workload:
    """The workload of an engine with the default EngineConfig buckets."""
    from multiserve.config import EngineConfig

    ec = EngineConfig()
    return workload_for(cfg, ec.precompile_token_paddings, ec.precompile_bs_paddings,
                        max(ec.precompile_bs_paddings), page_size or ec.page_size,
                        block_size or ec.attention_block_size, dtype, tp=tp,
                        moe_sharding=moe_sharding)
