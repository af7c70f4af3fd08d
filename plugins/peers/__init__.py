"""Reference implementations the benchmark compares against, run as subprocesses."""
