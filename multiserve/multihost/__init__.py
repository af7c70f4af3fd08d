"""One engine across several hosts (multi-controller JAX): docs/architecture.md §13."""
