"""The model package: the model families behind one interface (`families/`: dense Llama /
Qwen2 / Qwen3 in `llama.py`, Qwen3-MoE / Qwen2-MoE in `moe_decoder.py` + `moe.py`), over a
paged KV pool; weight loaders (HF safetensors dir, GGUF file), sharding helpers and the
embedded default model's locator.

Invariant: importing this package (or `default_model`, `errors`, the loaders, `families`)
does not import jax; the forward modules (`llama`, `moe_decoder`, `moe`, `attention`,
`kv_pool`, `sharding`, `forward_batch`, `family_forward`, `simple_generate`) do. Import the
submodules directly (`from multiserve.model.families import family_for`).
"""
