"""`multiserve doctor`: what an engine of a model would compute here, and how (`main`: the
invariance plan, the dtype, the bfloat16 path), and on an accelerator this machine does not
have (`target`: lowered for it; `steps`: the engine's step programs as abstract inputs;
`compile`: compiled for compile-only TPU chips). A command: above the engine and the model,
which it uses both."""
