"""`gpuvigil` command line. Each subcommand lives in its own module with `add_parser(sub)`,
which registers its arguments and sets `func` (called with the parsed args, returns an exit
code)."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from gpuvigil.errors import OneLineErrorParser, UserError
from gpuvigil.cli.subcommands import CURRENT_ARGV, selected_command

# command → (module, one-line help). Only the chosen command's module is imported, so the CLI
# starts fast and one command's heavy dependencies never slow another.
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("gpuvigil.app.demo", "run fault scenarios end to end on the simulated cluster"),
    "analyze": ("gpuvigil.offline.analyze", "diagnose logs, dumps and scrapes offline"),
    "replay": ("gpuvigil.offline.replay", "replay recorded history (Prometheus, files) through every detector: what would have fired"),
    "fr": ("gpuvigil.offline.fr", "cross-rank analysis of Flight Recorder dumps"),
    "serve": ("gpuvigil.app.serve", "run collectors, pipeline, scheduler, API and /metrics"),
    "agent": ("gpuvigil.fleet.agent", "node agent: collectors + node/GPU detectors, publishes to NATS JetStream (fleet)"),
    "detect": ("gpuvigil.fleet.detect", "job-level detectors over leased job partitions of NATS JetStream (fleet)"),
    "act": ("gpuvigil.fleet.act", "findings → alerts and hints, one leader through a NATS KV lease (fleet)"),
    "api": ("gpuvigil.api.cli", "serve the scheduler feedback API from a hint store"),
    "breaker": ("gpuvigil.api.breakercli", "the acting circuit breaker: status, close (a person closes it)"),
    "quarantine": ("gpuvigil.api.quarantinecli", "a person's moves on a node's quarantine record: hold, release"),
    "why": ("gpuvigil.api.whycli", "why the scheduler placed a job where it is, or why it waits (asks a running API)"),
    "alerts": ("gpuvigil.alerts.build", "build Prometheus rules and Alertmanager config"),
    "dashboards": ("gpuvigil.dashboards.build", "build Grafana dashboards"),
    "deploy": ("gpuvigil.deploy", "write deployment files for gpuvigil at scale (sharded Prometheus)"),
    "preflight": ("gpuvigil.preflight.cli", "check this node before a job or before it returns to service: PASS/WARN/FAIL, exit 0/1/2, 3 = cannot check"),
    "bench": ("gpuvigil.cli.bench", "run a benchmark and write docs/benchmarks.md"),
}


def build_parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog="gpuvigil", description="Observability and anomaly detection for GPU training clusters.")
    parser.add_argument("--version", action="version", version=f"gpuvigil {__import__('gpuvigil').__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineErrorParser)
    sub.required = True
    CURRENT_ARGV[:] = list(argv)
    chosen = selected_command(argv, list(COMMANDS))
    for name, (module_name, help_text) in COMMANDS.items():
        if name == chosen:
            importlib.import_module(module_name).add_parser(sub)
        else:
            sub.add_parser(name, help=help_text)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except UserError as exc:
        from gpuvigil.util.textsafe import printable  # messages quote file names and contents

        print(f"gpuvigil: error: {printable(str(exc), 2000, multiline=True)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
