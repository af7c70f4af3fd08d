"""`multiserve bench`'s flags are BenchOptions' fields (bench/options.py): one field per
flag, its default the field's, and the values the command line parsed, typed."""

from __future__ import annotations

import dataclasses

import pytest
from bench_args import bench_options

from multiserve.bench.options import BENCH_DEFAULTS, DERIVED, BenchOptions
from multiserve.cli import build_parser


def test_every_flag_is_a_field_with_the_fields_default() -> None:
    parsed = vars(build_parser().parse_args(["bench"]))
    flags = {k: v for k, v in parsed.items() if k not in ("command", "func")}
    assert set(flags) == {f.name for f in dataclasses.fields(BenchOptions)} - set(DERIVED)
    assert {k: getattr(BENCH_DEFAULTS, k) for k in flags} == flags
    assert bench_options() == BENCH_DEFAULTS


def test_the_options_hold_the_parsed_flags() -> None:
    o = bench_options("--num-prompts", "3", "--token-paddings", "64", "512", "--bs-paddings",
                      "8", "--peer", "llamacpp", "--no-interleave", "--temperature", "0.5",
                      "--seed", "7", "--fleet", "--clients-per-port", "2", "--speculative",
                      "--decode-steps-per-dispatch", "4")
    assert (o.num_prompts, o.token_paddings, o.bs_paddings) == (3, (64, 512), (8,))
    assert (o.peer, o.interleave, o.temperature, o.seed) == ("llamacpp", False, 0.5, 7)
    assert o.fleet and o.clients_per_port == 2 and o.speculative and not o.ab_speculation
    assert o.decode_steps_per_dispatch == 4
    assert o.output_len is None and o.peer_dtype == "float32"  # the run decides these
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.seed = 8  # type: ignore[misc]
