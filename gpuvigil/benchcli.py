"""`gpuvigil bench KIND`: benchmarks live in the top-level `benchmarks/` package, one module per
kind, each with `add_parser(sub)`."""

from __future__ import annotations

import importlib

BENCH_MODULES = ["benchmarks.pipeline", "benchmarks.scheduler", "benchmarks.detectors", "benchmarks.hook"]


def add_parser(sub) -> None:
    from gpuvigil.cli import OneLineErrorParser

    p = sub.add_parser("bench", help="run a benchmark and write its table to docs/benchmarks.md")
    bsub = p.add_subparsers(dest="bench", metavar="KIND", parser_class=OneLineErrorParser)
    bsub.required = True
    for name in BENCH_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:
                continue
            raise
        module.add_parser(bsub)
