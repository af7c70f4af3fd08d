"""SGLang's server flags on `multiserve serve` / `validate`, with SGLang's meaning.

Owns: `add_sglang_flags(parser)` (the supported flags, and a refusal for every known SGLang
server flag this server does not support: "unsupported SGLang flag --foo", exit code 2),
and `apply_sglang_flags(args, data)`, which writes the supported ones into a fleet config
document (the TOML's shape) before it is validated.

Supported, by the field each sets: `--model-path` (alias of --model: [model] path),
`--served-model-name` ([model] served_model_name), `--tp-size` (devices per engine:
without --config each engine gets that many consecutive devices; with one, each engine's
device_indexes must hold that many), `--mem-fraction-static`, `--context-length`
(max_context_len), `--max-running-requests`, `--chunked-prefill-size`, `--page-size`,
`--dtype`, `--enable-return-routed-experts`, `--max-loras-per-batch`, `--max-lora-rank` and
`--lora-paths NAME=PATH ...` (EngineConfig fields, for every engine, over the file's values;
`--lora-paths` or `--enable-lora` without `--max-loras-per-batch` hold SGLang's default 8
adapters, or as many as --lora-paths names).

Invariants: a flag that is not given changes nothing; a flag we do not support is never
silently ignored.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, NoReturn

from multiserve.config import ConfigError
from multiserve.fleet.config_loader import ENGINE_KEY_ALIASES

# flag -> the EngineConfig field it sets on every engine
ENGINE_FLAGS: dict[str, str] = {
    "mem_fraction_static": "mem_fraction_static",
    "context_length": "max_context_len",
    "max_running_requests": "max_running_requests",
    "chunked_prefill_size": "chunked_prefill_size",
    "page_size": "page_size",
    "dtype": "dtype",
    "max_loras_per_batch": "max_loras_per_batch",
    "max_lora_rank": "max_lora_rank",
    "lora_paths": "lora_paths",
    "enable_return_routed_experts": "enable_return_routed_experts",
}
DEFAULT_MAX_LORAS = 8  # SGLang's max_loras_per_batch
# SGLang's dtype names -> ours
DTYPES = {"auto": "auto", "float32": "float32", "float": "float32", "bfloat16": "bfloat16",
          "float16": "float16", "half": "float16"}
# SGLang server flags with no counterpart here (data or pipeline parallel, quantization, other
# backends, ...): each is refused by name.
UNSUPPORTED: tuple[str, ...] = (
    "--tokenizer-path", "--tokenizer-mode", "--skip-tokenizer-init", "--load-format",
    "--trust-remote-code", "--revision", "--kv-cache-dtype", "--quantization",
    "--quantization-param-path", "--dp-size", "--data-parallel-size", "--pp-size",
    "--pipeline-parallel-size", "--ep-size", "--expert-parallel-size", "--attention-backend",
    "--sampling-backend",
    "--grammar-backend", "--schedule-policy", "--schedule-conservativeness",
    "--cpu-offload-gb", "--enable-torch-compile", "--cuda-graph-max-bs",
    "--disable-cuda-graph", "--speculative-draft-model-path", "--speculative-num-steps",
    "--speculative-eagle-topk", "--enable-dp-attention", "--max-prefill-tokens",
    "--is-embedding", "--enable-multimodal", "--json-model-override-args", "--device",
    "--base-gpu-id", "--gpu-id-step",
)


class _Unsupported(argparse.Action):
    """Refuses the flag by name (argparse's error: usage, the message, exit code 2)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> NoReturn:
        parser.error(f"unsupported SGLang flag {option_string}: multiserve has no "
                     "counterpart (see `multiserve serve --help` for the SGLang flags it "
                     "accepts)")


def add_sglang_flags(p: argparse.ArgumentParser) -> None:
    """The supported SGLang flags (--model-path is --model's alias, added with it) and
    the refused ones."""
    p.add_argument("--served-model-name", default=None,
                   help="SGLang: the name /v1/models reports (default: from the model)")
    p.add_argument("--tp-size", type=int, default=None,
                   help="SGLang: devices per engine (tensor parallel); without --config "
                        "each of --engines engines gets this many consecutive devices")
    p.add_argument("--mem-fraction-static", type=float, default=None,
                   help="SGLang: share of memory for weights + KV pool (default: the "
                        "engine's rule, EngineConfig)")
    p.add_argument("--context-length", type=int, default=None,
                   help="SGLang: the longest prompt + output (EngineConfig max_context_len)")
    p.add_argument("--max-running-requests", type=int, default=None,
                   help="SGLang: samples decoding at once per engine")
    p.add_argument("--chunked-prefill-size", type=int, default=None,
                   help="SGLang: prompt tokens prefilled per step")
    p.add_argument("--page-size", type=int, default=None, help="SGLang: KV page size")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="SGLang: the compute dtype (half = float16, float = float32)")
    p.add_argument("--max-loras-per-batch", type=int, default=None,
                   help="SGLang: LoRA adapters an engine holds at once (default 0: no LoRA; "
                        "8 with --lora-paths / --enable-lora)")
    p.add_argument("--max-lora-rank", type=int, default=None,
                   help="SGLang: the largest LoRA rank (smaller ones are zero-padded; "
                        "default 16)")
    p.add_argument("--lora-paths", nargs="+", default=None, metavar="NAME=PATH",
                   help="SGLang: PEFT adapter directories loaded at start")
    p.add_argument("--enable-lora", action="store_true", default=None,
                   help="SGLang: LoRA on (adapters loaded later by /load_lora_adapter)")
    p.add_argument("--enable-return-routed-experts", action="store_const", const=True,
                   default=None,
                   help="SGLang: a MoE model's engines capture the experts every token was "
                        "routed to, so /generate may ask for them (return_routed_experts)")
    p.add_argument("--nnodes", type=int, default=None,
                   help="SGLang: hosts of one slice; an engine may span them (every host "
                        "runs the same command; sops/run-multi-host.md)")
    p.add_argument("--node-rank", type=int, default=None,
                   help="SGLang: this host's rank in the slice (0 leads: scheduler, servers, "
                        "supervisor; the others follow)")
    p.add_argument("--dist-init-addr", default=None, metavar="HOST:PORT",
                   help="SGLang: node 0's JAX coordinator; its step stream takes PORT + 1")
    for flag in UNSUPPORTED:
        p.add_argument(flag, nargs="?", action=_Unsupported, help=argparse.SUPPRESS)


def _absolute(entry: str) -> str:
    """`name=path` (a bare path: named by itself) with the path made absolute."""
    name, _, path = entry.rpartition("=")
    return f"{name or path}={Path(path).resolve()}" if path else entry


def apply_sglang_flags(args: argparse.Namespace, data: dict[str, Any],
                       from_file: bool) -> None:
    """Write the given SGLang flags into the fleet config document `data` (in place);
    `from_file`: the engines come from --config (else they were laid out here)."""
    slice_keys = {key: getattr(args, key) for key in ("nnodes", "node_rank", "dist_init_addr")
                  if getattr(args, key, None) is not None}
    if slice_keys:  # [fleet] keys (config_loader.MULTIHOST_KEYS); the command line wins
        data["fleet"] = {**(data.get("fleet") or {}), **slice_keys}
    name = getattr(args, "served_model_name", None)
    if name is not None:
        data["model"] = {**(data.get("model") or {}), "served_model_name": name}
    given = {field: getattr(args, flag) for flag, field in ENGINE_FLAGS.items()
             if getattr(args, flag, None) is not None}
    if "dtype" in given:
        given["dtype"] = DTYPES[given["dtype"]]
    if "lora_paths" in given:  # name=path, the path made absolute (workers' cwd may differ)
        given["lora_paths"] = [_absolute(entry) for entry in given["lora_paths"]]
    if "max_loras_per_batch" not in given and (
            "lora_paths" in given or getattr(args, "enable_lora", None)):
        given["max_loras_per_batch"] = max(DEFAULT_MAX_LORAS, len(given.get("lora_paths", ())))
    if given:  # the command line wins over the file's [engine] and each engine's values
        names = {*given, *(a for a, f in ENGINE_KEY_ALIASES.items() if f in given)}
        shared = data.get("engine")
        tables = [shared if isinstance(shared, dict) else {}, *(
            t for t in data.get("engines") or () if isinstance(t, dict))]
        for table in tables:
            for key in names:
                table.pop(key, None)
        data["engine"] = {**tables[0], **given}
    tp = getattr(args, "tp_size", None)
    if tp is None:
        return
    if tp < 1:
        raise ConfigError("tp_size", f"--tp-size must be >= 1, got {tp}")
    engines = data.get("engines") or []
    if not from_file:
        data["engines"] = [{**t, "device_indexes": list(range(i * tp, (i + 1) * tp))}
                           for i, t in enumerate(engines)]
        return
    for i, table in enumerate(engines):
        devs = table.get("device_indexes") if isinstance(table, dict) else None
        if isinstance(devs, list) and len(devs) != tp:
            raise ConfigError("tp_size", f"--tp-size {tp}: engines[{i}] of the config has "
                              f"{len(devs)} device(s); give a config whose engines have "
                              f"{tp} each, or no --config")

