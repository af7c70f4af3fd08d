"""The leader's per-step message of an engine spanning hosts (multiserve/multihost/): its
size and the host time to send it and have it decoded on the other end, at 1 and 64
decode rows, on this machine's loopback.

Runs one tiny engine in one process with `Runner.mirror` recording each device op, then
replays every recorded RunStep through a loopback socket to a reader thread (encode +
sendall + receive + decode), `--repeats` times. Prints a table (bytes, microseconds:
median and p90). Run under the machine-wide lock: flock /tmp/bench.lock python ...
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import threading
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=200)
    args = p.parse_args()
    from multiserve.config import EngineConfig
    from multiserve.engine.engine import Engine
    from multiserve.multihost import ops, wire
    from multiserve.reliability.tiny_model import tiny_engine_fields, write_tiny_model
    from multiserve.types import SamplingParams

    model = write_tiny_model(tempfile.mkdtemp())
    cfg = EngineConfig(model_path=str(model), **tiny_engine_fields(
        precompile_token_paddings=(1, 64), precompile_bs_paddings=(1, 64),
        max_running_requests=64, chunked_prefill_size=64))
    engine = Engine(cfg)
    steps: list[ops.RunStep] = []
    engine._parts.runner.mirror = lambda op: steps.append(op) if isinstance(
        op, ops.RunStep) else None
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    samples: dict[int, list[ops.RunStep]] = {}
    for rows in (1, 64):
        steps.clear()
        engine.generate(input_ids=[[1, 5 + i] for i in range(rows)],
                        sampling_params=greedy)
        samples[rows] = steps[-4:]  # decode steps (the prompts are one chunk)
    engine.shutdown()

    a, b = socket.socketpair()
    received = threading.Semaphore(0)

    def reader() -> None:
        while True:
            if wire.receive(b) is None:
                return
            received.release()

    threading.Thread(target=reader, daemon=True).start()
    print(f"{'rows':>5} {'T':>4} {'R':>4} {'bytes':>7} {'median us':>10} {'p90 us':>8}")
    for rows, msgs in samples.items():
        times = []
        for i in range(args.repeats):
            msg = msgs[i % len(msgs)]
            t0 = time.perf_counter()
            wire.send(a, msg)
            received.acquire()
            times.append((time.perf_counter() - t0) * 1e6)
        size = len(wire.encode(msgs[0]))
        parts = {k: getattr(msgs[0], k).nbytes for k in ("packed_step", "packed_sampling")}
        print(f"   (rows={rows}: packed arrays {parts} bytes)")
        times.sort()
        print(f"{rows:>5} {msgs[0].tokens:>4} {msgs[0].num_rows:>4} {size:>7} "
              f"{statistics.median(times):>10.0f} {times[int(0.9 * len(times))]:>8.0f}")
    wire.send(a, None)


if __name__ == "__main__":
    main()
