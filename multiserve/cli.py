"""`multiserve serve | validate | generate | doctor | bench | fuzz | chaos` — the command line.

Thin: parses arguments and hands over to fleet/launch.py, the model's simple generate
loop, or the benchmark. Heavy imports happen inside each command so `--help` is fast
and JAX is initialised by the command that owns it (the fleet sets the virtual device
count before JAX starts).
"""

from __future__ import annotations

import argparse
import sys

from multiserve.bench.options import (
    BENCH_DEFAULTS,
    DTYPES,
    PEER_CHOICES,
    WORKLOADS,
    BenchOptions,
)
from multiserve.bench.random_model import SIZES as RANDOM_MODEL_SIZES
from multiserve.fleet.sglang_flags import add_sglang_flags
from multiserve.host.collector import tune_collector


def _cmd_generate(args: argparse.Namespace) -> int:
    from multiserve.model.simple_generate import greedy_generate

    text = greedy_generate(args.model, args.prompt, max_new_tokens=args.max_new_tokens,
                           chat=not args.raw)
    print(text)
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from multiserve.fleet.launch import serve_main

    return serve_main(args)


def _cmd_validate(args: argparse.Namespace) -> int:
    from multiserve.fleet.validate import validate_main

    return validate_main(args)


def _cmd_doctor(args: argparse.Namespace) -> int:
    from multiserve.doctor.main import doctor_main

    return doctor_main(args)


def _cmd_bench(args: argparse.Namespace) -> int:
    from multiserve.bench.run import bench_main

    return bench_main(BenchOptions.from_args(args))


def _cmd_fuzz(args: argparse.Namespace) -> int:
    from multiserve.reliability.fuzz_run import fuzz_main

    return fuzz_main(args)


def _cmd_chaos(args: argparse.Namespace) -> int:
    from multiserve.reliability.chaos_run import chaos_main

    return chaos_main(args)


def _fleet_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None,
                   help="fleet config TOML (default: configs/cpu-4.toml semantics)")
    p.add_argument("--engines", type=int, default=None,
                   help="without --config: number of engines, one device each")
    p.add_argument("--port", type=int, default=None, help="first engine port (default 31000)")
    p.add_argument("--supervisor-port", type=int, default=None)
    p.add_argument("--front-door-port", type=int, default=None,
                   help="one OpenAI/SGLang port routing to every engine (sticky by "
                        "X-Session-ID, else longest prefix, else least loaded); 0: "
                        "ephemeral; -1: none (default: the config's, else none)")
    p.add_argument("--host", default=None)
    p.add_argument("--model", "--model-path", dest="model", default=None,
                   help="HF model dir or .gguf (default: SmolLM2); --model-path is SGLang's")
    p.add_argument("--shutdown-mode", choices=["drain", "abort"], default="abort")
    p.add_argument("--max-request-bytes", type=int, default=None,
                   help="refuse (413) request bodies over this many bytes, before parsing "
                        "(every server; default 8 MiB)")
    p.add_argument("--enable-memory-saver", action="store_true",
                   help="report sglang's enable_memory_saver=true in /get_server_info (slime "
                        "checks it equals offload_rollout); memory release works either way")
    p.add_argument("--speculative-algorithm", choices=["ngram"], default=None,
                   help="speculative decoding (outputs unchanged, bit for bit): n-gram drafts "
                        "from the request's prompt and output and earlier outputs of its prompt")
    p.add_argument("--speculative-num-draft-tokens", type=int, default=None,
                   help="the most draft tokens of one request in one step (default 8)")
    p.add_argument("--decode-steps-per-dispatch", type=int, default=None,
                   help="decode steps one dispatch runs in a compiled loop where no row "
                        "needs the host between tokens (no penalty, grammar or "
                        "min_new_tokens; outputs unchanged, bit for bit; default 1)")
    p.add_argument("--tool-call-parser", default=None,
                   help="tool-call format read from chat replies: hermes (qwen25), qwen3_coder, "
                        "llama3, mistral, pythonic, deepseekv3 (default: chosen from the chat "
                        "template, else hermes)")
    p.add_argument("--reasoning-parser", default=None,
                   help="split <think> reasoning into reasoning_content: qwen3, deepseek-r1 "
                        "(default: none)")
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template file replacing the model's own")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every engine and supervisor "
                        "endpoint (default: $MULTISERVE_API_KEY; none: open, loopback only)")
    add_sglang_flags(p)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="multiserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="greedy answer to one prompt (chat-templated)")
    g.add_argument("prompt")
    g.add_argument("--model", default=None, help="HF model dir or .gguf (default: SmolLM2)")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--raw", action="store_true", help="no chat template")
    g.set_defaults(func=_cmd_generate)

    s = sub.add_parser("serve", help="run the fleet: one server per engine + supervisor")
    _fleet_args(s)
    s.set_defaults(func=_cmd_serve)

    v = sub.add_parser("validate", help="start the fleet, send concurrent requests, check")
    _fleet_args(v)
    v.add_argument("--force-exit", action="store_true",
                   help="end with os._exit (0 only if every check held)")
    v.add_argument("--requests-per-engine", type=int, default=2)
    v.add_argument("--max-tokens", type=int, default=24)
    v.add_argument("--prompt", default="What is the capital of France?")
    v.add_argument("--inject-failure", action="store_true",
                   help="test hook: make one check fail on purpose")
    v.add_argument("--ignore-eos", action="store_true",
                   help="every answer runs to --max-tokens (fixed load, for throughput)")
    v.add_argument("--timeout", type=float, default=900.0,
                   help="with --force-exit: exit 1 if the whole run takes longer (seconds)")
    v.set_defaults(func=_cmd_validate)

    d = sub.add_parser("doctor", help="this machine's invariance plan (the determinism "
                       "probe table) for a model; exit 1 if not verified")
    d.add_argument("--model", default=None, help="HF dir or GGUF (default: embedded model)")
    d.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                   help="the engine dtype to calibrate (auto: as an engine resolves it)")
    d.add_argument("--tp", type=int, default=1, help="devices per engine")
    d.add_argument("--reprobe", action="store_true", help="probe again, ignore the cache")
    d.add_argument("--json", action="store_true", help="the plan and table as JSON")
    d.add_argument("--target", choices=("cuda", "tpu"), default=None,
                   help="lower the model forward for this accelerator with jax.export, "
                   "without one, and print the kernels it would start from")
    d.add_argument("--compile", action="store_true",
                   help="with --target tpu: compile every step program with the TPU "
                   "compiler (libtpu) for --topology and print what each holds and moves")
    d.add_argument("--topology", default="v5e:2x2",
                   help="with --compile: the TPU topology (v5e:2x2, v6e:2x2, v5p:2x2x1, "
                   "v4:2x2x1); the engine spans its first --tp chips")
    d.add_argument("--context", type=int, default=1024,
                   help="with --compile: tokens per sequence row of the floors (and the "
                   "page tables' width)")
    d.add_argument("--random-sizes", nargs="*", default=["1b"], dest="sizes",
                   help="with --compile: the random model shapes compiled besides --model "
                   "(bench/random_model.py sizes)")
    d.add_argument("--programs", nargs="*", default=None, metavar="KIND:SIZE",
                   help="with --compile: only these programs (forward:16 fused:64 "
                   "logits:16 sampler:16 steps:16 (steps: the program of K decode steps "
                   "per dispatch; multi: its deprecated name); default: every program of "
                   "an engine)")
    d.set_defaults(func=_cmd_doctor)
    D = BENCH_DEFAULTS  # every flag's default: a field of BenchOptions (bench/options.py)
    b = sub.add_parser("bench", help="offline throughput on the default model")
    b.add_argument("--num-prompts", type=int, default=D.num_prompts)
    b.add_argument("--output-len", type=int, default=D.output_len,
                   help="output tokens per prompt (default 128; 64 with --single-stream "
                        "or --fleet)")
    b.add_argument("--single-stream", action="store_true",
                   help="one prompt streamed: TTFT and tok/s (1 x --output-len)")
    b.add_argument("--rounds", type=int, default=D.rounds,
                   help="with --single-stream: cold streams of the prompt, one after another, "
                        "on each side (round i seeded SEED + i); tok/s is all their tokens "
                        "over their summed walls (default 5)")
    b.add_argument("--interleave", action=argparse.BooleanOptionalAction,
                   default=D.interleave,
                   help="with --single-stream and a peer: the peer's rounds alternate with "
                        "ours, each in its own peer process (default: on for llamacpp, whose "
                        "process starts in well under a second; off for vllm)")
    b.add_argument("--dtype", default=D.dtype, choices=DTYPES,
                   help="the engine's dtype (default: EngineConfig's, auto); the peer "
                        "computes in the dtype the engine resolves it to")
    b.add_argument("--fleet", action="store_true",
                   help="the fleet (--config, default configs/cpu-4.toml), one streaming "
                        "HTTP client per engine port, vs one engine with the same requests")
    b.add_argument("--config", default=D.config, help="with --fleet: the fleet config TOML")
    b.add_argument("--duration", type=float, default=D.duration,
                   help="with --fleet: a sustained chat load for this many seconds on each "
                        "side (closed-loop OpenAI chat clients, max_tokens 16/64/128, greedy "
                        "or sampled, half streamed) instead of one wave of streams")
    b.add_argument("--agent-sessions", type=int, default=D.agent_sessions,
                   help="a multi-turn agent workload of this many sessions on the fleet: "
                        "through its front door vs random engine ports (vs sglang-router "
                        "when installed), prefix hit rate and tok/s (bench/agent_bench.py)")
    b.add_argument("--agent-turns", type=int, default=D.agent_turns,
                   help="with --agent-sessions: turns per session")
    b.add_argument("--clients-per-port", type=int, default=D.clients_per_port,
                   help="with --fleet: concurrent clients on each engine's port (e.g. 2 for "
                        "8 clients on the 4-engine fleet)")
    b.add_argument("--peer", choices=PEER_CHOICES, default=D.peer,
                   help="compare with a peer run in its own env (scripts/peer-envs.sh)")
    b.add_argument("--peer-model", default=D.peer_model,
                   help="the peer's model (HF dir; .gguf for llamacpp); default: ours (for "
                        "llamacpp an F32 copy of our GGUF: the weights we compute with)")
    b.add_argument("--workload", choices=WORKLOADS, default=D.workload,
                   help="with --ab-speculation: chat prompts, grounded tasks (copy/rewrite/"
                        "extract from the prompt, code edits), or GRPO-like groups in 2 epochs")
    b.add_argument("--ab-speculation", action="store_true",
                   help="n-gram speculative decoding off and on in one run (same engine)")
    b.add_argument("--speculative", action="store_true",
                   help="n-gram speculative decoding on (every mode, --fleet included)")
    b.add_argument("--speculative-num-draft-tokens", type=int,
                   default=D.speculative_num_draft_tokens)
    b.add_argument("--decode-steps-per-dispatch", type=int,
                   default=D.decode_steps_per_dispatch,
                   help="engine decode_steps_per_dispatch (default: EngineConfig's, 1)")
    b.add_argument("--group-size", type=int, default=D.group_size,
                   help="--workload grpo: samples per prompt")
    b.add_argument("--no-overlap", action="store_true")
    b.add_argument("--ab-overlap", action="store_true", help="run overlap on AND off")
    b.add_argument("--model", default=D.model)
    b.add_argument("--max-running", type=int, default=D.max_running)
    b.add_argument("--peer-batch-size", type=int, default=D.peer_batch_size,
                   help="peer generate batch size (0: all prompts in one batch)")
    b.add_argument("--peer-threads", type=int, default=D.peer_threads,
                   help="peer threads (default: all cores)")
    b.add_argument("--no-progress", action="store_true", help="no progress bars")
    b.add_argument("--token-paddings", type=int, nargs="+", default=D.token_paddings,
                   help="engine precompile_token_paddings (default: EngineConfig's)")
    b.add_argument("--bs-paddings", type=int, nargs="+", default=D.bs_paddings,
                   help="engine precompile_bs_paddings (default: EngineConfig's)")
    b.add_argument("--chunked-prefill-size", type=int, default=D.chunked_prefill_size)
    b.add_argument("--max-total-tokens", type=int, default=D.max_total_tokens,
                   help="KV pool size in tokens")
    b.add_argument("--temperature", type=float, default=D.temperature,
                   help="sampling temperature of every request (0: greedy, the default)")
    b.add_argument("--seed", type=int, default=D.seed,
                   help="with --temperature > 0: request i is seeded SEED + i")
    b.add_argument("--no-breakdown", action="store_true",
                   help="batch mode: skip the step-time breakdown after the run")
    b.add_argument("--host-phases", action="store_true",
                   help="batch mode: time the engine thread's host work per step phase "
                        "(engine/host_phases.py) during the measured run, and print it")
    b.add_argument("--random-model", choices=tuple(RANDOM_MODEL_SIZES),
                   default=D.random_model,
                   help="a random-weight model of that size (and family: small-<family>; "
                        "bench/random_model.py, written once into the cache) instead of "
                        "--model")
    b.add_argument("--lora-adapters", type=int, default=D.lora_adapters,
                   help="batch or single stream: the base model alone, then the same run "
                   "with N random LoRA adapters loaded (requests round-robin over them), "
                   "and the ratio (bench/lora_bench.py)")
    b.add_argument("--lora-rank", type=int, default=D.lora_rank,
                   help="with --lora-adapters: their rank, on all seven target modules")
    b.set_defaults(func=_cmd_bench)
    f = sub.add_parser("fuzz", help="schema-fuzz the engine and supervisor apps of a tiny "
                       "fleet on loopback (needs the test extra: schemathesis)")
    f.add_argument("--cases", type=int, default=1000, help="cases per app")
    f.add_argument("--seed", type=int, default=0)
    f.add_argument("--engines", type=int, default=1)
    f.set_defaults(func=_cmd_fuzz)

    c = sub.add_parser("chaos", help="4 tiny engines on CPU virtual devices under random "
                       "load and random operations (loopback only), then checks")
    c.add_argument("--minutes", type=float, default=10.0)
    c.add_argument("--clients", type=int, default=16)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--max-requests", type=int, default=100_000)
    c.add_argument("--max-ops", type=int, default=10_000)
    c.set_defaults(func=_cmd_chaos)
    return parser


def main(argv: list[str] | None = None) -> int:
    tune_collector()  # this process is ours (host/collector.py)
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
