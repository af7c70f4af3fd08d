"""The single-stream measurement: ONE prompt, N tokens (greedy, or sampled with
`--temperature` and seed `--seed`), streamed as a chat client would receive them
(`multiserve bench --single-stream`, default 1 x 64).

How a run goes: `--rounds` rounds (default 5), and the peer the same prompt as many times:
interleaved (`--interleave`, the default where the peer starts in well under a second:
llama.cpp) ours round i, then the peer's round i in its own process, and so on, so that a
drift of a shared machine's speed during the run weighs on both sides alike; else all of
ours one after another, then all of the peer's (vLLM: a start-up of about a minute per
process). Our engine idles while the peer runs. A round flushes the prefix cache (cold, like
the peer), then t0, then `Engine.stream_sync` (the engine's streaming API): its TTFT is
the time from t0 to the first snapshot holding a token, its wall t0 to its last token.
tok/s is all rounds' tokens over their summed walls (one round of 64 tokens is ~0.6 s:
a busy moment of a shared machine moved a lone round's rate by 10-25%); TTFT p50 / p99
over the rounds, ITL over all gaps; each round's tok/s is in the JSON. Tokens are timed
when the caller's thread receives them (what a user sees), not on the engine thread. A
short stream runs first as warm-up (excluded).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from multiserve.bench.ours import request_params, spec_counts
from multiserve.bench.stats import Timeline, summarize, summarize_rounds, without_output_ids
from multiserve.types import GenerateRequest

TARGET_VS_PEER = 1.0  # float32 (issue 19)
TARGET_VS_PEER_BY_DTYPE = {"bfloat16": 1.2}  # issue 30: 1.2x llama.cpp on a BF16 GGUF
TARGET_TTFT_S = 0.3


def target_vs_peer(dtype: str | None) -> float:
    """The single stream's tok/s target against its peer for an engine of `dtype`."""
    return TARGET_VS_PEER_BY_DTYPE.get(dtype or "", TARGET_VS_PEER)


def stream_once(engine: Any, ids: Sequence[int], output_len: int, rid: str,
                temperature: float = 0.0, seed: int = 0, lora_name: str | None = None
                ) -> dict[str, Any]:
    """One cold streamed request (request 0 of the bench: seed `seed`); its figures
    (bench.stats.summarize) and output ids."""
    return stream_rounds(engine, ids, output_len, 1, rid, temperature, seed,
                         lora_name=lora_name)


def stream_rounds(engine: Any, ids: Sequence[int], output_len: int, rounds: int, rid: str,
                  temperature: float = 0.0, seed: int = 0,
                  after_round: Callable[[int], None] | None = None,
                  lora_name: str | None = None) -> dict[str, Any]:
    """`rounds` cold streamed requests of `ids`, one after another (round i is request i
    of the bench: seed `seed + i`); their figures together (bench.stats.summarize_rounds:
    all tokens over the summed walls), each round's tok/s, and their output ids.
    `after_round(i)` runs after round i, outside its timing (the peer's round i).
    `lora_name`: the LoRA adapter every round runs with (None: the base model)."""
    before = engine.get_internal_state()
    done: list[tuple[list[Timeline], float]] = []
    for i in range(rounds):
        flushed = engine.flush_cache()
        assert flushed.ok, f"bench: cannot flush before a run: {flushed.message}"
        params = request_params(output_len, temperature, seed, i)
        request = GenerateRequest(rid=f"{rid}-{i}" if rounds > 1 else rid,
                                  input_ids=tuple(ids), sampling=params, stream=True,
                                  lora_name=lora_name)
        tl = Timeline()
        t0 = time.perf_counter()
        for out in engine.stream_sync(request):
            now = time.perf_counter()
            tl.record(now, len(out.output_ids))
            if out.finished:
                tl.finished_at = now
                tl.finish_reason = out.finish_reason
                tl.output_ids = tuple(out.output_ids)
                if out.error:
                    raise RuntimeError(f"bench: the engine failed during the run: {out.error}")
        done.append(([tl], t0))
        if after_round is not None:
            after_round(i)
    after = engine.get_internal_state()
    timelines = [tls[0] for tls, _ in done]
    figures: dict[str, Any] = dict(summarize_rounds(done))
    steps = after["forward_ct"] - before["forward_ct"]
    figures.update({
        "rounds": rounds,
        "rounds_tokens_per_s": [float(summarize(tls, t0)["tokens_per_s"])
                                for tls, t0 in done],
        "steps": steps,
        "mean_step_ms": 1000.0 * float(figures["wall_s"]) / steps if steps else float("nan"),
        "finish_reasons": sorted({str(t.finish_reason) for t in timelines}),
        "exact_length": all(len(t.output_ids) == output_len for t in timelines),
        # greedy rounds must agree (the engine's determinism); sampled ones have own seeds
        "rounds_identical": len({t.output_ids for t in timelines}) == 1,
        "cache_miss_count": after["cache_miss_count"],
        "output_ids": [list(t.output_ids) for t in timelines],
        **spec_counts(before, after),
    })
    return figures


def merge_peer_rounds(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One peer result from its interleaved rounds (one process each, one prompt each):
    tok/s all tokens over the summed walls (as ours), TTFT p50 / p99 over the rounds' TTFTs,
    ITL p50 the median of the rounds' p50 and ITL p99 the largest round p99 (the rounds'
    gaps are not in their results), output ids in round order, peak RSS the largest, load
    the mean; the rest from the first round."""
    assert parts, "no peer rounds"
    tokens = sum(int(p["output_tokens"]) for p in parts)
    wall = sum(float(p["wall_s"]) for p in parts)
    ttfts = np.array([float(p["ttft_p50_s"]) for p in parts])
    merged = dict(parts[0])
    merged.update({
        "num_prompts": sum(int(p["num_prompts"]) for p in parts),
        "output_tokens": tokens, "wall_s": wall,
        "tokens_per_s": tokens / wall if wall > 0 else float("nan"),
        "ttft_p50_s": float(np.percentile(ttfts, 50)),
        "ttft_p99_s": float(np.percentile(ttfts, 99)),
        "itl_p50_s": float(np.median([float(p["itl_p50_s"]) for p in parts])),
        "itl_p99_s": max(float(p["itl_p99_s"]) for p in parts),
        "output_ids": [ids for p in parts for ids in p["output_ids"]],
        "peak_rss_mb": max(float(p["peak_rss_mb"]) for p in parts),
        "load_s": float(np.mean([float(p["load_s"]) for p in parts])),
        "rounds_tokens_per_s": [float(p["tokens_per_s"]) for p in parts],
        "interleaved": True,
    })
    return merged


def single_result(base: dict[str, Any], ours: dict[str, Any],
                  peer: dict[str, Any] | None, agreement: dict[str, float] | None
                  ) -> dict[str, Any]:
    """The JSON line of a single-stream run: `base` (model, device, start-up, ...) plus
    ours, the peer's figures and the ratios against the issue's targets."""
    res = dict(base)
    res.update({"mode": "single_stream", "num_prompts": 1,
                "ours": without_output_ids(ours),
                "tokens_per_s": ours["tokens_per_s"], "ttft_s": ours["ttft_p50_s"]})
    ratio = None
    if peer is not None:
        ratio = ours["tokens_per_s"] / peer["tokens_per_s"] if peer["tokens_per_s"] else None
        res["peer"] = without_output_ids(peer)
        res["peer_agreement"] = agreement
    res["ratio_vs_peer"] = ratio
    target = target_vs_peer(res.get("dtype"))
    res["targets"] = {
        "vs_peer": target,
        "vs_peer_met": None if ratio is None else ratio >= target,
        "ttft_s": TARGET_TTFT_S, "ttft_met": ours["ttft_p50_s"] < TARGET_TTFT_S,
        "zero_recompiles_met": res["cache_miss_count"] == 0,
    }
    return res
