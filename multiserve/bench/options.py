"""BenchOptions: the arguments of `multiserve bench`, typed, with their defaults.

The command line (cli.py) takes every `bench` flag's default from `BENCH_DEFAULTS` and
builds one BenchOptions from the parsed flags (`BenchOptions.from_args`); the bench
modules (run.py, fleet_bench.py, spec_bench.py) read nothing else. jax-free: the command
line imports it to build its parser.

Invariant: every field but `peer_dtype` is one flag (`--num-prompts` is `num_prompts`),
whose default is the field's.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from typing import Any

from multiserve.bench.peer import PEERS

PEER_CHOICES = ("none", *PEERS)
WORKLOADS = ("chat", "grounded", "grpo")  # --workload (bench/spec_bench.py)
DTYPES = ("auto", "float32", "bfloat16")
# fields that are no flag: derived by the run (bench/run.py bench_main)
DERIVED = ("peer_dtype",)


@dataclass(frozen=True)
class BenchOptions:
    num_prompts: int = 64
    output_len: int | None = None  # None: the mode's (bench/run.py, bench/fleet_bench.py)
    single_stream: bool = False
    rounds: int = 5
    interleave: bool | None = None  # None: the peer decides (bench/run.py _interleaved)
    dtype: str | None = None  # None: EngineConfig's
    fleet: bool = False
    config: str | None = None  # --fleet: None is configs/cpu-4.toml
    duration: float | None = None
    clients_per_port: int = 1
    peer: str = "none"
    peer_model: str | None = None
    workload: str = "chat"
    ab_speculation: bool = False
    speculative: bool = False
    speculative_num_draft_tokens: int | None = None
    decode_steps_per_dispatch: int | None = None  # None: EngineConfig's
    group_size: int = 8
    no_overlap: bool = False
    ab_overlap: bool = False
    model: str | None = None
    max_running: int | None = None
    peer_batch_size: int = 0  # 0: all prompts in one batch
    peer_threads: int | None = None  # None: all cores
    no_progress: bool = False
    token_paddings: tuple[int, ...] | None = None
    bs_paddings: tuple[int, ...] | None = None
    chunked_prefill_size: int | None = None
    max_total_tokens: int | None = None
    temperature: float = 0.0
    seed: int = 0
    no_breakdown: bool = False
    host_phases: bool = False
    random_model: str | None = None  # a size of bench/random_model.py (SIZES), or None
    lora_adapters: int = 0  # > 0: the LoRA comparison (bench/lora_bench.py)
    lora_rank: int = 16
    agent_sessions: int = 0  # > 0: the multi-turn agent workload (bench/agent_bench.py)
    agent_turns: int = 6
    # derived, not a flag: the dtype the engine resolves its config to, which the peer
    # computes in (set by bench_main before any peer runs)
    peer_dtype: str = "float32"

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> BenchOptions:
        """The options of parsed `bench` flags (every flag field must be there)."""
        values: dict[str, Any] = {f.name: getattr(args, f.name) for f in fields(cls)
                                  if f.name not in DERIVED}
        for name in ("token_paddings", "bs_paddings"):
            if values[name] is not None:
                values[name] = tuple(values[name])
        return cls(**values)


BENCH_DEFAULTS = BenchOptions()
