"""This process on its host, with no jax: Python's collector thresholds (`collector`), the
freed heap returned to the OS (`heap`), the process's resident memory (`process_memory`)."""
