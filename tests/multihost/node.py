"""One host of a test slice, run as its own process (tests/multihost/slice.py starts it).

`python node.py SCENARIO RANK NNODES ADDR MODEL_DIR OUT_JSON`: RANK 0 leads (builds the
engine over every device, runs SCENARIO, writes what it saw to OUT_JSON); other ranks
follow (multiserve/fleet/follower.py). NNODES 0 is the one-process reference: the
same engine over the same number of devices without a slice. Each process has
$NODE_DEVICES virtual CPU devices (2 unless set).
"""

from __future__ import annotations

import json
import os
import sys

per_host = int(os.environ.get("NODE_DEVICES", "2"))


def main() -> int:
    scenario, rank, nnodes, addr, model_dir, out_path = sys.argv[1:7]
    rank_i, n = int(rank), int(nnodes)
    total = per_host * max(n, 1) if n else int(os.environ.get("REF_DEVICES", "4"))
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={per_host if n else total}"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from multiserve.host.collector import tune_collector

    tune_collector()  # a host process, as `multiserve serve` sets it (multiserve/cli.py)
    from multiserve.config import EngineConfig
    from multiserve.reliability.tiny_model import tiny_engine_fields

    cfg = EngineConfig(model_path=model_dir, device_indexes=tuple(range(total)),
                       **tiny_engine_fields(precompile_token_paddings=(16, 64),
                                            precompile_bs_paddings=(8,),
                                            max_running_requests=8,
                                            chunked_prefill_size=64))
    if os.environ.get("NODE_PLAN"):  # a plan pinned (the run this one is compared with)
        from multiserve.model.invariance.plan import InvariancePlan

        with open(os.environ["NODE_PLAN"]) as f:
            cfg = cfg.with_updates(invariance_plan=InvariancePlan.from_json(json.load(f)))
    if not n and os.environ.get("REF_GLOO"):  # one process, the slice's collectives (gloo)
        import jax

        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(f"127.0.0.1:{os.environ['REF_GLOO']}", 1, 0)
    if n:
        from multiserve.config import MultiHostConfig
        from multiserve.multihost.session import start_slice

        mh = MultiHostConfig(nnodes=n, node_rank=rank_i, dist_init_addr=addr,
                             heartbeat_timeout_s=float(os.environ.get("NODE_HEARTBEAT", "10")),
                             startup_timeout_s=float(os.environ.get("NODE_STARTUP", "120")))
        from multiserve.multihost.fingerprint import flat_fields

        session = start_slice(mh, flat_fields(cfg))
        if rank_i != 0:
            from multiserve.fleet.follower import follow

            assert session.follower is not None
            code = follow(session.follower, cfg, rank_i)
            os._exit(code)
    from multiserve.multihost.session import current
    from tests.multihost import scenarios

    code = 1
    try:
        result = scenarios.run(scenario, cfg, model_dir, os.environ.get("NODE_PERTURBED"))
        with open(out_path, "w") as f:
            json.dump(result, f)
        code = 0
    finally:
        session = current()
        if session is not None and session.leader is not None:
            session.leader.close()  # the followers exit; no JAX exit barrier here either
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
