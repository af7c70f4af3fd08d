"""The platform under the slice: two processes x 2 virtual CPU devices, gloo collectives,
`jax.distributed.initialize`; a matmul sharded over all 4 global devices gives the bits
of one process with the same 4-device mesh and the same collectives
(tests/multihost/platform_probe.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.multihost.slice_procs import env, free_port_pair

pytestmark = pytest.mark.slow

PROBE = Path(__file__).with_name("platform_probe.py")
WAIT_S = 120.0


def _bits(nnodes: int, per_host: int, collectives: str) -> str:
    """Rank 0's RESULT; the followers are waited for first (the leader outlives them)."""
    addr = f"127.0.0.1:{free_port_pair()}"
    procs = [subprocess.Popen([sys.executable, str(PROBE), str(r), str(nnodes), addr,
                               str(per_host), collectives], env=env(),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
             for r in range(max(nnodes, 1))]
    outs = {r: procs[r].communicate(timeout=WAIT_S) for r in [*range(1, len(procs)), 0]}
    codes = {r: p.returncode for r, p in enumerate(procs)}
    assert all(c == 0 for c in codes.values()), (
        codes, {r: (o[-500:], e[-2000:]) for r, (o, e) in outs.items()})
    return next(line.split()[1] for line in outs[0][0].splitlines()
                if line.startswith("RESULT"))


def test_two_processes_give_the_bits_of_one_with_the_same_collectives() -> None:
    two = _bits(2, 2, "gloo")
    assert two == _bits(0, 4, "gloo")
    # JAX's in-process collectives give the same product up to the summation order
    import numpy as np

    default = np.frombuffer(bytes.fromhex(_bits(0, 4, "default")), np.float32)
    np.testing.assert_allclose(np.frombuffer(bytes.fromhex(two), np.float32), default,
                               rtol=1e-5, atol=1e-5)
