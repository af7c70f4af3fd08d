"""Compiling a program for a TPU this machine does not have, with the real TPU compiler
(`multiserve doctor --target tpu --compile`).

libtpu (the version jax's `tpu` extra pins, installed by the test extra) carries the TPU
compiler, and `jax.experimental.topologies.get_topology_desc` gives compile-only devices
of a named topology ("v5e:2x2": four "TPU v5 lite" chips; "v6e:2x2", "v5p:2x2x1",
"v4:2x2x1") in a process whose JAX_PLATFORMS is "cpu": nothing runs, nothing is
allocated. A program lowered with its arguments placed on those devices compiles to the
TPU program a TPU host would run (Mosaic kernels included), and the compiled program says
what it holds in HBM (`memory_analysis`) and what the compiler counts it moving
(`cost_analysis`: flops, bytes accessed).

What the compiler's count cannot see: a Pallas (Mosaic) kernel's cost is the
`pl.CostEstimate` its call carries (none: the compiler counts it as nothing but its call);
a loop body is counted once, whatever its trip count (hlo_ops.py multiplies the ops it
lists); the bytes a kernel reads from a page table's pages depend on the sequence lengths
at run time, which no static count knows.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from multiserve.model.hlo_ops import HloOps, hlo_ops

TOPOLOGIES = ("v5e:2x2", "v6e:2x2", "v5p:2x2x1", "v4:2x2x1")
DEFAULT_TOPOLOGY = "v5e:2x2"


class NoTpuCompiler(RuntimeError):
    """libtpu is not installed beside jax (or does not know the topology)."""


def topology_devices(name: str) -> list[Any]:
    """The compile-only TPU devices of topology `name` (module docstring). libtpu's
    lock file (one process per TPU host) is waived: compile-only devices own no chip, so
    several processes (a doctor beside a test run) may compile at once."""
    import os

    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    try:
        return list(topologies.get_topology_desc(platform="tpu", topology_name=name).devices)
    except Exception as e:  # noqa: BLE001 (the plugin's own message, with what to do)
        raise NoTpuCompiler(
            f"no TPU compiler for topology {name!r}: {type(e).__name__}: {e}. It needs libtpu "
            "at the version jax's `tpu` extra pins (pip install \"jax[tpu]==<jax's "
            "version>\"; the test extra installs it)") from e


@contextmanager
def no_persistent_cache() -> Iterator[None]:
    """JAX's persistent compilation cache off for a compile for compile-only devices: such
    a client cannot load an executable back (the read fails with a warning and compiles
    again), and a TPU program in a CPU process's cache is dead weight there."""
    import jax

    cached = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", cached)


@dataclass(frozen=True)
class Hbm:
    """What a compiled program holds in HBM, per chip (memory_analysis)."""

    arguments: int
    outputs: int
    temporaries: int
    aliased: int  # output bytes that reuse a donated argument's buffer
    code: int

    @property
    def peak(self) -> int:
        """Arguments + outputs not aliased + temporaries."""
        return self.arguments + self.outputs - self.aliased + self.temporaries


@dataclass(frozen=True)
class CompiledCost:
    """One compiled program: HBM, the compiler's count, and its ops as hlo_ops reads them;
    or the error that stopped the compile."""

    hbm: Hbm | None = None
    flops: float = 0.0
    bytes_accessed: float = 0.0
    transcendentals: float = 0.0
    ops: HloOps | None = None
    seconds: float = 0.0
    error: str | None = None


def compile_cost(fn: Any, args: tuple[Any, ...], static: dict[str, Any],
                 options: dict[str, Any]) -> CompiledCost:
    """Lower the jitted `fn` at `args` (abstract, placed on compile-only devices) and
    compile it with XLA `options`; its costs, or the error (never raised)."""
    import time

    t0 = time.monotonic()
    try:
        with no_persistent_cache():
            compiled = fn.lower(*args, **static).compile(options)
    except Exception as e:  # noqa: BLE001 (reported: the compiler's own message)
        return CompiledCost(error=f"{type(e).__name__}: {e}", seconds=time.monotonic() - t0)
    seconds = time.monotonic() - t0
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis() or {}
    if isinstance(cost, list):  # older jax: one dict per device program
        cost = cost[0] if cost else {}
    hbm = Hbm(mem.argument_size_in_bytes, mem.output_size_in_bytes, mem.temp_size_in_bytes,
              mem.alias_size_in_bytes, mem.generated_code_size_in_bytes)
    return CompiledCost(hbm, float(cost.get("flops", 0.0)),
                        float(cost.get("bytes accessed", 0.0)),
                        float(cost.get("transcendentals", 0.0)), hlo_ops(compiled.as_text()),
                        seconds)
