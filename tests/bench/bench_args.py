"""The options `multiserve bench ARGV...` runs with, parsed as the command line parses them."""

from __future__ import annotations

from multiserve.bench.options import BenchOptions
from multiserve.cli import build_parser


def bench_options(*argv: str) -> BenchOptions:
    return BenchOptions.from_args(build_parser().parse_args(["bench", *argv]))
