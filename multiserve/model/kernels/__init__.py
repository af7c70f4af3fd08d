"""The native CPU kernels: C++ sources (src/: paged attention, the row-invariant product and
its grouped form), built with the machine's compiler on first use and bound as XLA FFI
custom calls (native.py)."""
