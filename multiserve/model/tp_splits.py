"""Which dimensions a tensor-parallel group splits (`tp_splits`): the same rule for every
model family, its sharding specs (model/families/, model/sharding.py), the products the
calibration probes (model/invariance/workload.py) and the step's collectives
(model/tensor_parallel.py). Plain data (no jax): the loaders import it."""

from __future__ import annotations

from multiserve.config import ModelConfig


def tp_splits(cfg: ModelConfig, n: int) -> dict[str, bool]:
    """Which dimensions a tensor-parallel group of `n` devices splits (a dimension is split
    only where it divides by n): attention heads (both head counts must divide), the dense
    MLP's intermediate dim, the vocabulary, and the hidden size (the output dimension of
    the products back into the residual stream: o_proj, down_proj; no product splits its
    contraction, model/tensor_parallel.py)."""
    return {"attention": n > 1 and cfg.num_heads % n == 0 and cfg.num_kv_heads % n == 0,
            "mlp": n > 1 and cfg.intermediate_size % n == 0,
            "vocab": n > 1 and cfg.vocab_size % n == 0,
            "hidden": n > 1 and cfg.hidden_size % n == 0}
