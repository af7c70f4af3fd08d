"""The native kernels' arithmetic is the source's on every CPU: the forms of one LoRA sum
that the kernels promise equal (one token or a register block of several, a vector rank or
a scalar one, B read itself or from its float32 stage, the applied delta by vectors or by
single columns) give the same bits in a build for each of several -march targets, and
every build that fuses multiply-adds gives the same bits as every other.

The probe (lora_arithmetic_probe.cc) inlines the kernels' own per-element code
(model/kernels/src/lora_math.h, with float_ops.h's explicit multiply-adds) and is built
with the kernels' own flags (native.FLAGS) but for -march. A target this compiler does not
know, or whose instructions this CPU cannot run, is left out and named in the test's
output (`pytest -rA`); `native` always runs. Before float_ops.h the forms differed on an Intel
Xeon (family 6, model 167) built with -march=native: GCC's SLP vectoriser turned four
multiply-adds of a scalar sum into one vector multiply and four adds, which the vector
form did not do."""

from __future__ import annotations

import platform
import shutil
import signal
import subprocess
from pathlib import Path

import numpy as np
import pytest

from multiserve.model.kernels import native

PROBE = Path(__file__).with_name("lora_arithmetic_probe.cc")
# the host's own, Intel's and AMD's server tunings, AVX2 with FMA, and SSE only (no FMA:
# its forms must agree among themselves; its sums round twice, so it is not compared)
X86_TARGETS = ("native", "sapphirerapids", "znver3", "x86-64-v3", "x86-64-v2")


def _cpu_flags() -> set[str]:
    """This CPU's flags (/proc/cpuinfo's first "flags" line; empty where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _targets() -> tuple[str, ...]:
    return X86_TARGETS if platform.machine() in ("x86_64", "AMD64") else ("native",)


def test_the_kernels_build_without_contraction() -> None:
    """The compiler fuses nothing on its own: every fused multiply-add is written."""
    assert "-ffp-contract=off" in native.FLAGS and "-ffast-math" not in native.FLAGS


def _probe_bits(tmp_path: Path, source: Path, variants: list[tuple[str, list[str]]],
                includes: list[str], failure: str) -> tuple[dict[str, np.ndarray], list[str]]:
    """Builds `source` once per (name, extra flags) variant with the kernels' own flags
    (native.FLAGS less -march and the shared-object ones), in parallel, runs each build
    (argv[1]: the file it writes) and reads its output as uint32 words. A variant this
    compiler does not know or whose instructions this CPU lacks is left out (named in the
    second result), never a "native" one; a build exiting otherwise fails with `failure`."""
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler on this machine: the engine uses XLA's formulations")
    flags = [f for f in native.FLAGS if f not in ("-shared", "-fPIC") and
             not f.startswith("-march=")]
    builds = {}
    for name, extra in variants:
        exe = tmp_path / f"probe-{name}"
        builds[name] = (exe, subprocess.Popen(
            [cxx, *flags, *extra, *includes, str(source), "-o", str(exe)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    bits: dict[str, np.ndarray] = {}
    left_out: list[str] = []
    for name, (exe, build) in builds.items():
        _, err = build.communicate()
        if build.returncode != 0:
            assert not name.startswith("native"), err[-2000:]
            left_out.append(f"{name}: not known to this compiler")
            continue
        out = tmp_path / f"bits-{name}"
        done = subprocess.run([str(exe), str(out)], capture_output=True, text=True)
        if done.returncode == -signal.SIGILL:
            assert not name.startswith("native")
            left_out.append(f"{name}: instructions this CPU lacks")
            continue
        assert done.returncode == 0, f"{name}: {failure}\n{done.stderr[-3000:]}"
        bits[name] = np.fromfile(out, np.uint32)
    return bits, left_out


def test_every_form_of_a_lora_sum_gives_the_same_bits_on_every_target(tmp_path) -> None:
    bits, left_out = _probe_bits(
        tmp_path, PROBE, [(t, [f"-march={t}"]) for t in _targets()],
        ["-I", str(native.SOURCES[0].parent)], "forms differ")
    fused = {t: b[1:] for t, b in bits.items() if b[0] == 1}
    assert "native" in bits and bits["native"].size > 10_000
    reference = next(iter(fused.values()), None)
    for target, b in fused.items():
        assert np.array_equal(b, reference), f"-march={target} differs from the other builds"
    if left_out:  # shown with -rA or on failure
        print("left out:", "; ".join(left_out))


# the products' register blocks and the attention's items, each probe including its
# kernel's source whole
PRODUCT_PROBES = ("row_gemm_probe.cc", "row_gemm_bf16_probe.cc", "paged_attention_probe.cc")


@pytest.mark.parametrize("probe", PRODUCT_PROBES)
def test_the_products_register_blocks_give_the_same_bits_in_each_path(
        tmp_path, probe: str) -> None:
    """A row-invariant product's register blocks (every size, plain and warming; the
    float32 product's one-row panel; the bfloat16 product's widening path for float32 and
    bfloat16 x into each output form) give the same bits in two builds of different
    paths (below): AVX-512's blocks, AVX2's column passes, the generic block."""
    import jax

    # two builds, each path against another: on an AVX-512 CPU its own build and the AVX2
    # build (x86-64-v3: the column passes); on any other, its own build (the column passes
    # where it has AVX2) and the generic block
    variants = [("native", ["-march=native"])]
    if platform.machine() in ("x86_64", "AMD64") and "avx512f" in _cpu_flags():
        variants.append(("x86-64-v3", ["-march=x86-64-v3"]))
    else:
        variants.append(("native-generic", ["-march=native", "-DMULTISERVE_GENERIC_BLOCK"]))
    bits, left_out = _probe_bits(
        tmp_path, Path(__file__).with_name(probe), variants,
        ["-I", str(native.SOURCES[0].parent), "-I", jax.ffi.include_dir()], "the probe failed")
    assert len(bits) == 2 and bits["native"].size > 5_000, left_out
    fused = {t: b[1:] for t, b in bits.items() if b[0] == 1}
    reference = next(iter(fused.values()), None)
    for name, b in fused.items():
        assert np.array_equal(b, reference), f"{name} differs from the other builds"
    if left_out:
        print("left out:", "; ".join(left_out))
