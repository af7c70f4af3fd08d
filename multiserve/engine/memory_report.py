"""What one engine holds in memory: get_internal_state's (and so get_server_info's) "memory".

`memory_report(runner, pool)` counts, from the live objects, never from estimates:
- weights: the bytes of the device arrays held for the weights (`Runner.held_params` and
  `Runner.compute_params`): the canonical params' size (each leaf once, in whichever
  layout it is held), the extra copies the invariance plan runs on beyond that (transposed
  matrices, panel padding, a head in a second layout), and how much of the params is held
  in the canonical layout itself (the rest only in a compute layout, e.g. an all-native
  plan's layer matrices as panels: Runner's invariant on `params`);
- the KV pool: its bytes, the tokens it serves (page 0, the padding sink, counted apart),
  bytes per token, and how its size was chosen (engine/base/kv_sizing.py);
- the compiled step programs: how many executables (a sampler shared by several row
  buckets counted once), and what XLA's memory analysis says of them: the scratch
  (`temp`) each needs while it runs, and the generated code's size where the backend
  reports it (XLA:CPU reports 0 for it, given here as None: not measured).

Invariants: read only, on the engine thread (between two steps), like state_report.py;
bytes are those of the whole engine (every device of its group); a released part (memory
release) counts 0 bytes and is named in `released`. Memory analyses are cached per
executable (they never change), so polling costs no XLA call after the first.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import jax

from multiserve.engine.base.kv_sizing import PoolSize
from multiserve.engine.device.programs import KINDS
from multiserve.model.layers.kv_pool import kv_bytes_per_token
from multiserve.model.sharding import attention_sharded

if TYPE_CHECKING:
    from multiserve.engine.device.runner import Runner

# executable -> (generated code bytes, temp bytes); computed once per executable
_ANALYSES: weakref.WeakKeyDictionary[Any, tuple[int, int]] = weakref.WeakKeyDictionary()


def array_bytes(tree: Any) -> int:
    """Bytes of the distinct device arrays in `tree` (an array reached twice counts once;
    a multi-device array counts its shard on each of its devices). Reads only the arrays'
    metadata: asking for a buffer's address or shards would make jax create (and keep)
    more array objects, which tests that count live arrays would see."""
    seen: dict[int, int] = {}
    for a in jax.tree.leaves(tree):
        if isinstance(a, jax.Array) and not a.is_deleted():
            seen[id(a)] = placed_bytes(a)
    return sum(seen.values())


def placed_bytes(a: jax.Array | jax.ShapeDtypeStruct) -> int:
    """Bytes an array of this shape, dtype and sharding takes on its devices (its shard on
    each of them)."""
    shard = math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize
    return shard * len(a.sharding.device_set)


def executables(runner: Runner) -> Iterator[Any]:
    """The distinct compiled executables of the runner's step programs (a head's logits
    and sampler programs apart; a sampler shared by several heads once)."""
    seen: set[int] = set()
    for kind in KINDS:
        for size in runner.programs.ready(kind):
            program = runner.programs.get(kind, size)
            parts = (program.logits, program.sampler) if hasattr(program, "sampler") \
                else (program,)
            for part in parts:
                if part is not None and id(part) not in seen:
                    seen.add(id(part))
                    yield part


def _analysis(executable: Any) -> tuple[int, int]:
    cached = _ANALYSES.get(executable)
    if cached is None:
        try:
            stats = executable.memory_analysis()
            cached = (int(stats.generated_code_size_in_bytes), int(stats.temp_size_in_bytes))
        except Exception:  # noqa: BLE001 - a backend without memory analysis
            cached = (0, 0)
        _ANALYSES[executable] = cached
    return cached


def programs_report(runner: Runner) -> dict[str, Any]:
    analyses = [_analysis(e) for e in executables(runner)]
    code = sum(c for c, _ in analyses)
    return {"count": len(analyses),
            # None: the backend does not report it (XLA:CPU)
            "generated_code_bytes": code or None,
            "temp_bytes_max": max((t for _, t in analyses), default=0),
            "temp_bytes_total": sum(t for _, t in analyses)}


def memory_report(runner: Runner, pool: PoolSize | None) -> dict[str, Any]:
    """The "memory" block (module docstring); `pool`: how the KV size was chosen (None:
    not known, e.g. a runner built outside engine/setup.py)."""
    page = runner.cfg.page_size
    per_token = kv_bytes_per_token(runner.model_cfg, runner.dtype, runner.kv_layout,
                                   attention_sharded(runner.model_cfg, runner.mesh))
    held = runner.held_params
    canonical = array_bytes(held)
    params = 0 if held is None else sum(
        placed_bytes(s) for s in jax.tree.leaves(runner.param_specs))
    weights = array_bytes((held, runner.compute_params))
    kv = array_bytes(runner.kv)
    released = [name for name, kept in (("weights", held is not None),
                                        ("kv_cache", runner.kv is not None)) if not kept]
    return {
        "weights_bytes": weights,
        "weights_params_bytes": params,
        "weights_copies_bytes": weights - params,
        "weights_canonical_bytes": canonical,
        "kv_pool_bytes": kv,
        "kv_pool_tokens": (runner.num_pages - 1) * page,  # page 0 excluded (padding sink)
        "kv_pool_padding_tokens": page,
        "kv_bytes_per_token": per_token,
        "kv_pool_rule": pool.rule if pool is not None else None,
        "kv_pool_budget_bytes": pool.budget_bytes if pool is not None else None,
        "programs": programs_report(runner),
        "released": released,
    }
