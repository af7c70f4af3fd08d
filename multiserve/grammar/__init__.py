"""Grammar-constrained decoding, jax-free (shared by the HTTP side and the engine).

- `grammar.py`: `Grammar`, the compiled constraint a `SamplingParams` carries;
- `compiler.py`: `GrammarCompiler`, request constraints (JSON schema, regex, EBNF / lark,
  structural tags, tool choices) -> cached, validated `Grammar`s, off the engine thread;
- `matcher_state.py`: `GrammarState`, one sample's matcher in the engine (advanced with
  every emitted token, rebuilt by replay).
"""
