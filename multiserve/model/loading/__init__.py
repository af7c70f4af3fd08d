"""Every model source, jax-free (params stay numpy on the host): `loader.load_model` (the
one entry point), HF safetensors directories (hf.py, hf_names.py, safetensors_io.py), GGUF
files (gguf.py, gguf_tokenizer.py) converted once into a cache (model_cache.py), the
embedded default model (default_model.py), the params layout (param_layout.py)."""
