"""Where a test run's compile and calibration time goes, per test file and per program.

A pytest plugin (loaded by name: scripts/ on PYTHONPATH, `-p compile_profile`) and the
summary of what it wrote. Each test process writes one JSON file to the directory named by
$MULTISERVE_COMPILE_PROFILE when it finishes; the summary adds them up. Only the pytest
processes are seen: the fleets, followers and CLI runs the tests start compile in
subprocesses of their own (their programs still fill the same persistent cache).

What it records, from JAX's monitoring events and two wrapped calls:
- XLA compiles: JAX's backend-compile event spans `compile_or_get_cached`, so it also
  fires on a persistent-cache hit (a read, no compile). A hit is told apart by the
  cache-retrieval event the same thread reports inside it: "compiles" below are misses
  only, "hits" the reads, each with its seconds.
- tracing and lowering (jaxpr trace, jaxpr -> MLIR): paid on every new jit or shape in
  a process, persistent cache or not.
- the invariance calibration's probes (`calibration._probe`: a plan probed, not read from
  the cache), and the compiles made while one runs ("CAL:" before the program's name).
- the native kernels' build (`native._compile_to`).

All seconds are wall-clock in the process that paid them: on a machine with fewer cores
than test processes they include waiting for a core.

A run from nothing (empty caches), then the summary:

    P=$(mktemp -d); MULTISERVE_CACHE_DIR=$(mktemp -d) JAX_COMPILATION_CACHE_DIR=$(mktemp -d) \\
      MULTISERVE_COMPILE_PROFILE=$P PYTHONPATH=scripts bash scripts/test.sh -p compile_profile
    python scripts/compile_profile.py $P
"""

from __future__ import annotations

import collections
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

_FILE = ["<collection>"]  # the test file running now in this process
_BY_FILE: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
_BY_PROGRAM: collections.Counter[str] = collections.Counter()
_LOCK = threading.Lock()
_CALIBRATING = [0]  # calibration probes running now in this process
_THREAD = threading.local()  # .hit: the current compile event was a cache read


def _add(counter: collections.Counter[str], **amounts: float) -> None:
    with _LOCK:
        counter.update(amounts)


def _on_duration(event: str, duration_secs: float, **kwargs: str | int) -> None:
    name = event.rsplit("/", 1)[-1]
    here = _BY_FILE[_FILE[0]]
    if name == "cache_retrieval_time_sec":
        _THREAD.hit = True
        _add(here, hit_s=duration_secs, hits=1)
    elif name == "jaxpr_trace_duration":
        _add(here, trace_s=duration_secs, traces=1)
    elif name == "jaxpr_to_mlir_module_duration":
        _add(here, lower_s=duration_secs, lowerings=1)
    elif name == "backend_compile_duration":
        hit = getattr(_THREAD, "hit", False)
        _THREAD.hit = False
        if hit:
            return  # counted by its retrieval event
        program = ("CAL:" if _CALIBRATING[0] else "") + str(kwargs.get("fun_name"))
        _add(here, compile_s=duration_secs, compiles=1)
        _add(_BY_PROGRAM, **{program: duration_secs, program + "#n": 1})


def _timed(owner: Any, attr: str, key: str, nested: list[int] | None = None) -> None:
    """Wrap `owner.attr` so its seconds add to the current file's `key`."""
    inner = getattr(owner, attr)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.monotonic()
        if nested is not None:
            nested[0] += 1
        try:
            return inner(*args, **kwargs)
        finally:
            if nested is not None:
                nested[0] -= 1
            _add(_BY_FILE[_FILE[0]], **{key + "_s": time.monotonic() - t0, key + "s": 1})

    setattr(owner, attr, wrapper)


def pytest_configure(config: Any) -> None:
    import jax.monitoring

    from multiserve.model.invariance import calibration
    from multiserve.model.kernels import native

    jax.monitoring.register_event_duration_secs_listener(_on_duration)
    _timed(calibration, "_probe", "calibration", _CALIBRATING)
    _timed(native, "_compile_to", "native_build")


def pytest_runtest_setup(item: Any) -> None:
    path = Path(str(item.path)).resolve()
    _FILE[0] = path.as_posix().split("/tests/", 1)[-1]


def pytest_sessionfinish(session: Any) -> None:
    out = os.environ.get("MULTISERVE_COMPILE_PROFILE")
    if not out or not any(_BY_FILE.values()):
        return  # not asked, or a process that ran no test (xdist's controller)
    Path(out).mkdir(parents=True, exist_ok=True)
    name = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with open(Path(out) / f"{name}-{os.getpid()}.json", "w") as f:
        json.dump({"files": {k: dict(v) for k, v in _BY_FILE.items()},
                   "programs": dict(_BY_PROGRAM)}, f)


def summary(folder: Path, top: int = 25) -> str:
    """The tables: totals, the files by compile + calibration seconds, the programs by
    compile seconds."""
    files: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    programs: collections.Counter[str] = collections.Counter()
    for path in sorted(folder.glob("*.json")):
        data = json.loads(path.read_text())
        for name, amounts in data["files"].items():
            files[name].update(amounts)
        programs.update(data["programs"])
    total: collections.Counter[str] = collections.Counter()
    for amounts in files.values():
        total.update(amounts)
    cal = sum(v for k, v in programs.items() if k.startswith("CAL:") and "#" not in k)
    lines = [f"compiles {total['compiles']:.0f} ({total['compile_s']:.1f} s, of which "
             f"{cal:.1f} s in calibrations); cache reads {total['hits']:.0f} "
             f"({total['hit_s']:.1f} s); traces {total['traces']:.0f} "
             f"({total['trace_s']:.1f} s); lowerings {total['lowerings']:.0f} "
             f"({total['lower_s']:.1f} s); calibrations probed {total['calibrations']:.0f} "
             f"({total['calibration_s']:.1f} s); native builds {total['native_builds']:.0f} "
             f"({total['native_build_s']:.1f} s)", "",
             f"{'test file':52s} {'compiles':>8s} {'s':>7s} {'hits':>6s} {'calib':>5s} "
             f"{'s':>6s} {'trace+lower s':>13s}"]
    ranked = sorted(files.items(), key=lambda kv: -(kv[1]["compile_s"]
                                                     + kv[1]["calibration_s"]))
    for name, a in ranked[:top]:
        lines.append(f"{name[:52]:52s} {a['compiles']:8.0f} {a['compile_s']:7.1f} "
                     f"{a['hits']:6.0f} {a['calibrations']:5.0f} {a['calibration_s']:6.1f} "
                     f"{a['trace_s'] + a['lower_s']:13.1f}")
    lines += ["", f"{'program':52s} {'compiles':>8s} {'s':>7s} {'s each':>7s}"]
    names = sorted((k for k in programs if "#" not in k), key=lambda k: -programs[k])
    for name in names[:top]:
        n = programs[name + "#n"]
        lines.append(f"{name[:52]:52s} {n:8.0f} {programs[name]:7.1f} "
                     f"{programs[name] / n:7.3f}")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python scripts/compile_profile.py PROFILE_DIR")
    print(summary(Path(sys.argv[1])))
