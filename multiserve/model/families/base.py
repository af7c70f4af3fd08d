"""The model interface: what one model family provides (`ModelFamily`), and the record
that ties an HF tensor name to a leaf of our params (`HfTensorSpec`).

A family is one module under model/families/ (registered in `families/__init__.py`). The
engine, the loaders, RL weight updates, sharding and the calibration talk only to this
interface (`families.family_for(cfg)`), never to a family's forward directly:

- HF config -> ModelConfig (`config_from_hf`) and back (`config_to_hf`);
- the canonical params layout (`param_shapes`: a dict pytree, matrices [in, out], leaves
  stacked over their layers) and the HF names of its tensors (`hf_tensor_specs`), and how
  a checkpoint's packed tensors unpack into them (`unpack_hf_tensors`);
- sharding rules over an engine's device group (`param_specs`; the KV pool's and the
  attention's split is the same for every family: model/tp_splits.py, sharding.py);
- what the invariance calibration must probe: every dense product (`product_shapes`) and
  grouped expert product (`grouped_shapes`); the row sums (RMSNorm widths) follow from the
  config for every family (invariance/workload.py, `workload_for`);
- the compute params a step runs on (`compute_params`: the layouts the plan's kernels read),
  the decoder up to the final-normed hidden states (`forward_hidden`; a mixture-of-experts
  family's `forward_hidden_routed` also returns every token's top-k expert ids per MoE
  layer, [T, len(cfg.moe_layers), k] int32, for routing replay), the output head
  (`lm_head`), and which step sizes run a scanned decoder (`scans`) and up to which size
  the decoder runs unrolled (`unroll_max_tokens`), for the warm-up's order;
- which canonical leaves an engine need not hold beside the compute params, because these
  rebuild them exactly (`params_to_hold`), and their rebuilding (`canonical_params`,
  `canonical_leaf`);
- what a weight update from disk must agree on (`config_fields`).

Module-level imports here are plain data (no jax), so the loaders stay jax-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from multiserve.config import ModelConfig

if TYPE_CHECKING:  # the step's types (jax): for the checker only, the loaders stay jax-free
    import jax
    from jax.sharding import Mesh

    from multiserve.model.invariance.plan import InvariancePlan
    from multiserve.model.layers.forward_batch import ForwardBatch
    from multiserve.model.layers.kv_pool import KVPool
    from multiserve.model.tensor_parallel import TensorParallel


@dataclass(frozen=True)
class HfTensorSpec:
    """Where one HF tensor lives in our params: params[key] (layer None), or
    params[group][key][layer] (a leaf stacked over its layers), or
    params[group][key][layer, expert] (a leaf stacked over layers and experts);
    `hf_shape` is the shape under its HF name; `transposed`: ours is its transpose."""

    key: str
    layer: int | None
    hf_shape: tuple[int, ...]
    transposed: bool
    group: str = "layers"
    expert: int | None = None

    @property
    def path(self) -> tuple[str, ...]:
        """The leaf's path in the params pytree."""
        return (self.key,) if self.layer is None else (self.group, self.key)

    @property
    def index(self) -> tuple[int, ...]:
        """Where this tensor sits in its leaf (() for a whole leaf)."""
        if self.layer is None:
            return ()
        return (self.layer,) if self.expert is None else (self.layer, self.expert)


@dataclass(frozen=True)
class ProductShape:
    """One contraction x[M, K] @ W[K, N] the model runs: `k`, `n` global; `split` says which
    side a tensor-parallel group splits ("in", "out" or "" for replicated); `rows`: "tokens"
    (runs at every token bucket) or "rows" (the head: every logits-row bucket)."""

    name: str
    k: int
    n: int
    split: str = ""
    rows: str = "tokens"


class ModelFamily(Protocol):
    """One model family (see module docstring)."""

    name: str
    architectures: dict[str, str]  # HF class name -> our ModelConfig.architecture
    model_types: tuple[str, ...]  # HF model_type values (a config without architectures)

    def config_from_hf(self, raw: dict[str, Any], arch: str, source: Path,
                       common: dict[str, Any]) -> ModelConfig: ...

    def config_to_hf(self, cfg: ModelConfig) -> dict[str, Any]: ...

    def param_shapes(self, cfg: ModelConfig) -> dict[str, Any]: ...

    def hf_tensor_specs(self, cfg: ModelConfig) -> dict[str, HfTensorSpec]: ...

    def unpack_hf_tensors(self, named: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
        """A checkpoint's HF-named tensors as stored -> the tensors `hf_tensor_specs`
        names (GPT-OSS: its MXFP4 experts de-quantized); the same dict where nothing is
        packed."""
        ...

    def param_specs(self, cfg: ModelConfig, mesh: Mesh, moe_sharding: str) -> dict[str, Any]: ...

    def product_shapes(self, cfg: ModelConfig, tp: int, moe_sharding: str
                       ) -> list[ProductShape]: ...

    def grouped_shapes(self, cfg: ModelConfig, tp: int, moe_sharding: str
                       ) -> list[ProductShape]: ...

    def compute_params(self, params: dict[str, Any], cfg: ModelConfig,
                       plan: InvariancePlan | None, token_sizes: tuple[int, ...]
                       ) -> dict[str, Any]: ...

    def params_to_hold(self, params: dict[str, Any], compute: dict[str, Any]
                       ) -> dict[str, Any]:
        """The leaves of the canonical `params` an engine keeps beside their compute form
        `compute` (`compute_params(params, ...)`): all but those `compute` holds in a
        layout that rebuilds them exactly, which no step reads in the canonical form."""
        ...

    def canonical_params(self, held: dict[str, Any], compute: dict[str, Any],
                         cfg: ModelConfig) -> dict[str, Any]:
        """The whole canonical params from `params_to_hold`'s tree and `compute`, the
        leaves left out rebuilt bit for bit (new arrays)."""
        ...

    def canonical_leaf(self, held: dict[str, Any], compute: dict[str, Any],
                       cfg: ModelConfig, path: tuple[str, ...]) -> Any:
        """One leaf of `canonical_params` by path: the held one, or that one alone rebuilt
        (a read-back rebuilds nothing else)."""
        ...

    def forward_hidden(self, params: dict[str, Any], kv_pool: KVPool, batch: ForwardBatch,
                       cfg: ModelConfig, *, page_size: int, attn_block_size: int,
                       plan: InvariancePlan, tp: TensorParallel | None = None
                       ) -> tuple[jax.Array, KVPool]: ...

    def forward_hidden_routed(self, params: dict[str, Any], kv_pool: KVPool,
                              batch: ForwardBatch,
                              cfg: ModelConfig, *, page_size: int, attn_block_size: int,
                              plan: InvariancePlan, tp: TensorParallel | None = None
                              ) -> tuple[jax.Array, KVPool, jax.Array]:
        """(as forward_hidden, expert ids [T, Lm, k] int32); ValueError for a dense family."""
        ...

    def lm_head(self, params: dict[str, Any], h: jax.Array, plan: InvariancePlan,
                cfg: ModelConfig) -> jax.Array:
        """Logits f32 [R, V] of final-normed hidden states h [R, D]."""
        ...

    def scans(self, plan: InvariancePlan, num_tokens: int) -> bool: ...

    @property
    def unroll_max_tokens(self) -> int:
        """Token buckets above this compile in the warm-up's first phase (the scanned
        decoder's fast compile); those at or below it are unrolled (slower compiles, last)
        unless the plan makes every size scan."""
        ...

    config_fields: tuple[str, ...]  # ModelConfig fields a disk update must match
