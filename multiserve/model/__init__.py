"""The model package, in five rooms (import the submodules directly):

- `families/`: the model interface (base.py), its registry (__init__), the families (dense:
  Llama / SmolLM2 / Qwen2 / Qwen3; qwen_moe: Qwen3-MoE / Qwen2-MoE) and their forwards
  (llama.py, moe_decoder.py, moe.py, forward.py);
- `layers/`: what every family's forward is made of: paged attention, the KV pool, the
  ForwardBatch contract, the per-token LoRA deltas;
- `invariance/`: the invariance plan (what each row-invariant primitive computes at each
  size), the primitives that follow it, and the calibration that measures it on this machine
  (workload, probes, choice, on-disk store, driver), which `multiserve doctor`
  (multiserve/doctor/main.py) shows;
- `kernels/`: the native CPU kernels (sources in src/, their build and XLA FFI bindings);
- `loading/`: every model source (HF safetensors dirs, GGUF files, the embedded default
  model), tensor names, the params layout, the conversion cache.

Beside them: `errors` (ModelLoadError), `lora_layout` (the LoRA adapter buffers' layout;
their forward is layers/lora.py), `sharding` (placement on a device group),
`simple_generate` (an unbatched greedy loop), `testing` (random models for tests).

Invariant: importing this package, `errors`, `families` (the registry and interface),
`loading`, `lora_layout` or `testing` does not import jax; the forwards, `layers`, `invariance`, `kernels`,
`sharding` and `simple_generate` do.
"""
