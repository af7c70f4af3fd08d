"""`multiserve bench`: offline throughput benchmark (entry point: `run.bench_main`).

Jax is imported only when a benchmark runs; torch never (peers run as subprocesses
from plugins/peers/)."""
