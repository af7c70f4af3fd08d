"""The platform spike, kept: a jitted matmul whose contraction is sharded over a Mesh of
every global device (so it all-reduces), run as one process of a slice or alone.

`python platform_probe.py RANK NNODES ADDR PER_HOST COLLECTIVES`: NNODES 0 is one process
with PER_HOST devices; COLLECTIVES "gloo" (the slice's) or "default" (JAX's in-process
CPU collectives; one process only). Prints `RESULT <hex of the float32 bits>` from the
first host, which then waits for its stdin to close: its process hosts JAX's coordination
service, and a follower still running when that goes is aborted by its JAX client, so the
test closes the leader's stdin only once every follower has exited.
"""

from __future__ import annotations

import os
import sys


def main() -> None:
    rank, nnodes, addr, per_host, collectives = sys.argv[1:6]
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={per_host}"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    if collectives == "gloo":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(addr, max(int(nnodes), 1), int(rank),
                                   initialization_timeout=120)
    mesh = Mesh(np.array(jax.devices()), ("tp",))
    rng = np.random.default_rng(0)
    a = rng.standard_normal((8, 64), dtype=np.float32)
    b = rng.standard_normal((64, 32), dtype=np.float32)
    ga = jax.make_array_from_callback(a.shape, NamedSharding(mesh, P(None, "tp")),
                                      lambda i: a[i])
    gb = jax.make_array_from_callback(b.shape, NamedSharding(mesh, P("tp", None)),
                                      lambda i: b[i])
    out = jax.jit(lambda x, y: x @ y, out_shardings=NamedSharding(mesh, P()))(ga, gb)
    bits = np.asarray(out.addressable_data(0)).tobytes().hex()  # every host waits for it
    if collectives == "gloo":  # no host leaves before all have their result
        from jax._src.distributed import global_state

        global_state.client.wait_at_barrier("probe-done", 60_000)
    if int(rank) == 0:
        print("RESULT", bits, flush=True)
        sys.stdin.read()  # the followers have exited when the test closes it
    sys.stdout.flush()
    os._exit(0)  # not JAX's exit barrier: the test only needs the bits


if __name__ == "__main__":
    main()
