"""The single-stream measurement: ONE prompt, N tokens (greedy, or sampled with
`--temperature` and seed `--seed`), streamed as a chat client would receive them
(`multiserve bench --single-stream`, default 1 x 64).

How a run goes: flush the prefix cache (cold, like the peer), then t0, then
`Engine.stream_sync` (the engine's streaming API): TTFT is the time from t0 to the
first snapshot holding a token, tok/s is N / (last token - t0), ITL the gaps between
tokens. Tokens are timed when the caller's thread receives them (what a user sees),
not on the engine thread. A short stream runs first as warm-up (excluded).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from multiserve.bench.ours import request_params, spec_counts
from multiserve.bench.stats import Timeline, summarize
from multiserve.types import GenerateRequest

TARGET_VS_PEER = 1.0  # float32 (issue 19)
TARGET_VS_PEER_BY_DTYPE = {"bfloat16": 1.2}  # issue 30: 1.2x llama.cpp on a BF16 GGUF
TARGET_TTFT_S = 0.3


def target_vs_peer(dtype: str | None) -> float:
    """The single stream's tok/s target against its peer for an engine of `dtype`."""
    return TARGET_VS_PEER_BY_DTYPE.get(dtype or "", TARGET_VS_PEER)


def stream_once(engine: Any, ids: Sequence[int], output_len: int, rid: str,
                temperature: float = 0.0, seed: int = 0) -> dict[str, Any]:
    """One cold streamed request (request 0 of the bench: seed `seed`); its figures
    (bench.stats.summarize) and output ids."""
    flushed = engine.flush_cache()
    assert flushed.ok, f"bench: cannot flush before a run: {flushed.message}"
    before = engine.get_internal_state()
    params = request_params(output_len, temperature, seed, 0)
    request = GenerateRequest(rid=rid, input_ids=tuple(ids), sampling=params, stream=True)
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
    after = engine.get_internal_state()
    figures: dict[str, Any] = dict(summarize([tl], t0))
    steps = after["forward_ct"] - before["forward_ct"]
    figures.update({
        "steps": steps,
        "mean_step_ms": 1000.0 * float(figures["wall_s"]) / steps if steps else float("nan"),
        "finish_reasons": [str(tl.finish_reason)],
        "exact_length": len(tl.output_ids) == output_len,
        "cache_miss_count": after["cache_miss_count"],
        "output_ids": [list(tl.output_ids)],
        **spec_counts(before, after),
    })
    return figures


def single_result(base: dict[str, Any], ours: dict[str, Any],
                  peer: dict[str, Any] | None, agreement: dict[str, float] | None
                  ) -> dict[str, Any]:
    """The JSON line of a single-stream run: `base` (model, device, start-up, ...) plus
    ours, the peer's figures and the ratios against the issue's targets."""
    res = dict(base)
    res.update({"mode": "single_stream", "num_prompts": 1,
                "ours": {k: v for k, v in ours.items() if k != "output_ids"},
                "tokens_per_s": ours["tokens_per_s"], "ttft_s": ours["ttft_p50_s"]})
    ratio = None
    if peer is not None:
        ratio = ours["tokens_per_s"] / peer["tokens_per_s"] if peer["tokens_per_s"] else None
        res["peer"] = {k: v for k, v in peer.items() if k != "output_ids"}
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
