"""The layers every family's forward is made of: paged attention (attention.py), the paged
KV pool (kv_pool.py), the ForwardBatch contract between engine and model (forward_batch.py),
RoPE (rope.py) and RMSNorm (norm.py). All of them import jax."""
