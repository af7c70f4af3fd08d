"""ForwardBatch: everything one forward step needs besides params and the KV pool.

Invariants (the engine builds it, the model trusts it; all int32, padded to bucket sizes):
- `input_ids`, `positions`, `token_seq`, `out_slots`: [T], one entry per new token.
  `token_seq[t]` is the row of `page_table`/`seq_lens` holding token t's sequence.
  `out_slots[t] = page * page_size + offset` is where token t's K/V is written; padding
  tokens write into page 0, which is reserved as a garbage page and never read as real data.
- `page_table`: [B, max_pages], the page ids of each sequence in order (padding 0).
- `seq_lens`: [B], KV length of each sequence INCLUDING this step's tokens (0 for padding).
  (The pure-JAX attention derives its loop bounds and causal mask from `positions` alone;
  `seq_lens` is part of the contract for kernels that need it.)
- `logit_rows`: [R], token rows whose logits are returned (padding rows point at any valid
  row, e.g. 0).
- `lora_slots`: [T], each token's LoRA adapter slot (0: none; padding tokens 0), only in
  an engine with LoRA (model/layers/lora.py); None (no pytree leaf) otherwise.
"""

from __future__ import annotations

import jax
from flax import struct


@struct.dataclass
class ForwardBatch:
    input_ids: jax.Array  # [T] int32
    positions: jax.Array  # [T] int32
    token_seq: jax.Array  # [T] int32
    out_slots: jax.Array  # [T] int32
    page_table: jax.Array  # [B, max_pages] int32
    seq_lens: jax.Array  # [B] int32
    logit_rows: jax.Array  # [R] int32
    lora_slots: jax.Array | None = None  # [T] int32, only with LoRA

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]
