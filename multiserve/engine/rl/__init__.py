"""The RL subsystem of one engine: staged weight updates and memory release/resume.

Layout: `control.py` (RLControl, the one object the Engine composes and forwards its RL
methods to), `weights.py` (WeightManager: stage, publish, discard, read back),
`memory.py` (MemoryManager: release and resume device buffers), `checks.py` (validation
of tensors and checkpoints against the served model; no engine state).

Invariant: nothing here assigns a field of the engine core, the runner, the scheduler or
the prefix cache, or wraps a request's sink; it uses their narrow methods
(`EngineCore.hold/release_hold`, `swap_params`, `set_weight_version`, `drop_kv`,
`install_kv`; `Scheduler.retract`, `drop_cached_kv`), on the engine thread.
"""
