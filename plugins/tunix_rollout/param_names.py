"""Tunix's Llama / Qwen nnx param paths -> the Hugging Face tensor names multiserve takes.

`TABLE` is the mapping: one row per Tunix param path pattern (tunix/models/llama3, qwen2,
qwen3: dense models), the HF name it is, and how its array turns into the HF orientation.
`hf_named_arrays(state)` applies it to a Tunix params state (an `nnx.State`, or its
flat (path, value) pairs) and returns {HF name: jax.Array}.

Invariants: every transform is a reshape and/or a transpose run by JAX on the arrays'
own devices, so values are moved, never recomputed or cast, and nothing goes to the host;
a path that no row matches raises KeyError naming it (a param is never dropped silently).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import jax

Transform = Callable[[jax.Array], jax.Array]


def _same(x: jax.Array) -> jax.Array:
    return x


def _t(x: jax.Array) -> jax.Array:
    """[in, out] kernel -> HF [out, in]."""
    return x.T


def _heads_in(x: jax.Array) -> jax.Array:
    """q/k/v einsum weight [D, heads, head_dim] -> HF [heads * head_dim, D]."""
    return x.reshape(x.shape[0], -1).T


def _heads_out(x: jax.Array) -> jax.Array:
    """o einsum weight [heads, head_dim, D] -> HF [D, heads * head_dim]."""
    return x.reshape(-1, x.shape[-1]).T


def _flat(x: jax.Array) -> jax.Array:
    """q/k/v bias [heads, head_dim] -> HF [heads * head_dim]."""
    return x.reshape(-1)


@dataclass(frozen=True)
class Row:
    pattern: str  # a Tunix param path ("layers.3.attn.q_proj.w"), as a regex
    hf_name: str  # the HF tensor name, with \1 for the layer index
    transform: Transform


L = r"layers\.([0-9]+)\."
TABLE: tuple[Row, ...] = (
    Row(r"embedder\.input_embedding", "model.embed_tokens.weight", _same),
    Row(r"final_norm\.w", "model.norm.weight", _same),
    Row(r"lm_head\.w", "lm_head.weight", _t),
    Row(L + r"input_layernorm\.w", r"model.layers.\1.input_layernorm.weight", _same),
    Row(L + r"post_attention_layernorm\.w", r"model.layers.\1.post_attention_layernorm.weight",
        _same),
    Row(L + r"attn\.q_proj\.w", r"model.layers.\1.self_attn.q_proj.weight", _heads_in),
    Row(L + r"attn\.k_proj\.w", r"model.layers.\1.self_attn.k_proj.weight", _heads_in),
    Row(L + r"attn\.v_proj\.w", r"model.layers.\1.self_attn.v_proj.weight", _heads_in),
    Row(L + r"attn\.o_proj\.w", r"model.layers.\1.self_attn.o_proj.weight", _heads_out),
    Row(L + r"attn\.q_bias", r"model.layers.\1.self_attn.q_proj.bias", _flat),  # qwen2
    Row(L + r"attn\.k_bias", r"model.layers.\1.self_attn.k_proj.bias", _flat),
    Row(L + r"attn\.v_bias", r"model.layers.\1.self_attn.v_proj.bias", _flat),
    Row(L + r"attn\.q_norm\.w", r"model.layers.\1.self_attn.q_norm.weight", _same),  # qwen3
    Row(L + r"attn\.k_norm\.w", r"model.layers.\1.self_attn.k_norm.weight", _same),
    Row(L + r"mlp\.gate_proj\.kernel", r"model.layers.\1.mlp.gate_proj.weight", _t),
    Row(L + r"mlp\.up_proj\.kernel", r"model.layers.\1.mlp.up_proj.weight", _t),
    Row(L + r"mlp\.down_proj\.kernel", r"model.layers.\1.mlp.down_proj.weight", _t),
)
_COMPILED = tuple((re.compile(row.pattern + r"\Z"), row) for row in TABLE)


def hf_name(tunix_path: str) -> tuple[str, Transform]:
    """The HF name of one Tunix param path and the transform of its array."""
    for rx, row in _COMPILED:
        m = rx.match(tunix_path)
        if m is not None:
            return m.expand(row.hf_name), row.transform
    raise KeyError(f"Tunix param {tunix_path!r}: no row of plugins/tunix_rollout/param_names.py "
                   "maps it to a Hugging Face name")


def flat_params(state: Any) -> Iterable[tuple[str, jax.Array]]:
    """(dotted path, array) of every param of a Tunix params state."""
    from flax import nnx

    items = nnx.to_flat_state(state) if isinstance(state, nnx.State) else state
    for path, leaf in items:
        value = leaf.get_value() if isinstance(leaf, nnx.Variable) else leaf
        yield ".".join(str(p) for p in path), value


def hf_named_arrays(state: Any) -> dict[str, jax.Array]:
    """{HF name: jax.Array in HF orientation} of a Tunix params state (see module doc)."""
    out: dict[str, jax.Array] = {}
    for path, value in flat_params(state):
        name, transform = hf_name(path)
        out[name] = transform(value)
    return out
