"""`gpuvigil bench KIND`: benchmarks live in the top-level `benchmarks/` package, one module per
kind, each with `add_parser(sub)`. Only the chosen benchmark's module is imported."""

from __future__ import annotations

import importlib

BENCHMARKS: dict[str, tuple[str, str]] = {
    "pipeline": ("benchmarks.pipeline", "samples/s through collect → window → detect, and tick time"),
    "scheduler": ("benchmarks.scheduler", "trace-driven placement and fault study on the Alibaba trace"),
    "detectors": ("benchmarks.detectors", "labelled detector suite: precision, recall, latency vs baselines"),
    "hook": ("benchmarks.hook", "in-process hook overhead per training step"),
    "api": ("benchmarks.api", "feedback API read latency and throughput at 20k findings"),
    "replay": ("benchmarks.replay", "replay of a month of 1,000 GPUs at 30 s (scaled slice, extrapolated)"),
    "replay-real": ("benchmarks.replay_real", "OOM ahead on real GPU memory series with seeded leaks, via a real Prometheus, vs the usual alert rules"),
    "scale": ("benchmarks.scale", "fleet on NATS: agent CPU per node, detect core throughput, latency, failover (docs/scale.md)"),
    "incidents": ("benchmarks.incidents", "messages to on-call per injected fault, every built-in scenario (simulated)"),
    "realistic": ("benchmarks.realistic", "the detectors on real sample rates (DCGM 30 s, NVML 1 s) and fault time scales (leaks over hours)"),
    "components": ("benchmarks.components", "the failed switch, PDU or cooling loop named instead of its nodes drained (fat tree, InfiniteHBD trace, simulated findings)"),
    "faults": ("benchmarks.faults", "fault study: GPU-hours lost, nodes out, the breaker in a mass XID storm, queue p95 with paired CIs over seeds"),
    "soak": ("benchmarks.soak", "serve at 10k simulated GPUs for minutes with faults, restarts and a full disk"),
}


def add_parser(sub) -> None:
    from gpuvigil.errors import OneLineErrorParser
    from gpuvigil.cli.subcommands import CURRENT_ARGV, selected_command

    p = sub.add_parser("bench", help="run a benchmark and write its table to docs/benchmarks.md")
    bsub = p.add_subparsers(dest="bench", metavar="KIND", parser_class=OneLineErrorParser)
    bsub.required = True
    argv = CURRENT_ARGV
    after = argv[argv.index("bench") + 1 :] if "bench" in argv else []
    chosen = selected_command(after, list(BENCHMARKS))
    for name, (module_name, help_text) in BENCHMARKS.items():
        if name == chosen:
            importlib.import_module(module_name).add_parser(bsub)
        else:
            bsub.add_parser(name, help=help_text)
