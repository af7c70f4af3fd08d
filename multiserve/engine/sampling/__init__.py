"""The sampler: on device (`sampler`, jitted, batch-invariant) and its host side (`host`:
per-request parameters as padded arrays, logprob records)."""
