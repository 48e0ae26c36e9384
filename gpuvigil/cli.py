"""`gpuvigil` command line. Each subcommand lives in its own module with `add_parser(sub)`,
which registers its arguments and sets `func` (called with the parsed args, returns an exit
code)."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from gpuvigil.errors import UserError

# Order here is the order in `gpuvigil --help`.
COMMAND_MODULES = [
    "gpuvigil.demo",  # demo
    "gpuvigil.analyze",  # analyze
    "gpuvigil.collectors.flight_recorder",  # fr
    "gpuvigil.serve",  # serve
    "gpuvigil.api.cli",  # api
    "gpuvigil.alerts.build",  # alerts build
    "gpuvigil.dashboards.build",  # dashboards build
    "gpuvigil.benchcli",  # bench pipeline|scheduler|detectors|hook
]


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr and exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog="gpuvigil", description="Observability and anomaly detection for GPU training clusters.")
    parser.add_argument("--version", action="version", version=f"gpuvigil {__import__('gpuvigil').__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineErrorParser)
    sub.required = True
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:  # not written yet
                continue
            raise
        module.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except UserError as exc:
        print(f"gpuvigil: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
