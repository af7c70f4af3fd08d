"""The benchmark peers' command-line protocol, shared by every plugins/peers/*_generate.py.

A peer is run by `multiserve bench` (multiserve/bench/peer.py) as a subprocess with its
OWN interpreter (.venv-peers/<name>/bin/python, made by scripts/peer-envs.sh) and the
multiserve checkout on PYTHONPATH; it imports only the standard library, its own
framework, this module and multiserve.bench.stats (pure Python, no jax).

Arguments: --prompts-file P.json ({"prompts": [[id, ...], ...]}), --output-len M,
--model PATH (an HF dir, or a .gguf file for llama.cpp; --model-dir is the old name),
--batch-size B (0: all prompts at once), --threads T, --stream (time every token as it
arrives: the single-stream measurement), --no-warmup, --temperature T (0, the default:
greedy; else sample at T with top_p / top_k / min_p off) and --seed S (prompt i is
seeded S + i where the framework allows a seed per request).
Output: ONE JSON line on stdout (the last line starting with "{"), holding at least
peer, num_prompts, output_len, output_tokens, wall_s, tokens_per_s, ttft_p50_s,
ttft_p99_s, itl_p50_s, itl_p99_s, batch_size, threads, load_s, peak_rss_mb,
exact_length and output_ids (the generated ids, one list per prompt, in order); with
--temperature > 0 also temperature, seed and seeding (how the peer seeded its draws,
e.g. per request or one seed per batch when the framework has no per-request seed).
Anything else (logs, progress) goes to stderr: `reserve_stdout()` keeps the real stdout
for that line and points file descriptor 1 at stderr, so frameworks that log to stdout
(vLLM does, from child processes too) cannot break the protocol.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, TextIO


def parse_args(description: str, argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--prompts-file", required=True)
    p.add_argument("--output-len", type=int, required=True)
    p.add_argument("--model", "--model-dir", dest="model", required=True,
                   help="HF model dir (or .gguf file for llama.cpp)")
    p.add_argument("--batch-size", type=int, default=0, help="0: all prompts in one batch")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--stream", action="store_true",
                   help="time each token as it arrives (single-stream measurement)")
    p.add_argument("--no-warmup", action="store_true")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--seed", type=int, default=0, help="prompt i is seeded seed + i")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="the compute dtype (the engine's, so the comparison is like for "
                        "like; llama.cpp takes it from its GGUF file)")
    return p.parse_args(argv)


def sampling_record(args: argparse.Namespace, seeding: str) -> dict[str, Any]:
    """The result's sampling fields: temperature, base seed and how the peer seeded
    (`seeding`; "none" when greedy)."""
    sampled = args.temperature > 0
    return {"temperature": args.temperature, "seed": args.seed,
            "seeding": seeding if sampled else "none (greedy)"}


def load_prompts(path: str) -> list[list[int]]:
    """The prompts as token-id lists; SystemExit(2) if any is empty."""
    with open(path, encoding="utf-8") as f:
        prompts = [list(map(int, ids)) for ids in json.load(f)["prompts"]]
    if not prompts or any(not ids for ids in prompts):
        print("peer: every prompt needs at least one token id", file=sys.stderr)
        raise SystemExit(2)
    return prompts


def reserve_stdout() -> TextIO:
    """The real stdout, for `emit`; from now on anything written to fd 1 (this process
    and its children) goes to stderr."""
    sys.stdout.flush()
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    return out


def emit(result: dict[str, Any], out: TextIO | None = None) -> None:
    """Print the result as the one JSON line the caller reads."""
    print(json.dumps(result), file=out or sys.stdout, flush=True)
