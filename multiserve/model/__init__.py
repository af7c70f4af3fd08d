"""The model package: a flax Llama-family decoder over a paged KV pool, its weight loaders
(HF safetensors dir, GGUF file), sharding helpers and the embedded default model's locator.

Invariant: importing this package (or `default_model`, `errors`, the loaders) does not import
jax; only `llama`, `attention`, `kv_pool`, `sharding`, `forward_batch` and `simple_generate` do.
Import the submodules directly (`from multiserve.model.llama import forward`).
"""
