"""The RL subsystem of one engine: staged weight updates and memory release/resume.

Layout: `weights.py` (WeightManager: stage, publish, discard, read back), `memory.py`
(MemoryManager: release and resume device buffers), `checks.py` (validation of tensors and
checkpoints against the served model; no engine state). The engine composes them through
its ControlRunner (engine/control_runner.py).

Invariant: the managers are given the engine as an `RLInterface` (engine/rl_interface.py)
and use only its public methods (`hold/release_hold`, `swap_params`, `set_weight_version`,
`drop_kv`, `install_kv`, `retract_running`, ...), on the engine thread, through the typed
RL commands (engine/commands.py) that `ControlRunner.execute` runs; nothing here assigns a
field of another object, names the core's scheduler, prefix cache or allocator, or wraps
a request's sink.
"""
