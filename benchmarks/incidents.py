"""`gpuvigil bench incidents`: messages on-call receives per injected fault, every built-in scenario.

Each scenario runs on the simulated cluster (gpuvigil/sim: 1 Hz samples, fast faults) through the
whole pipeline, as `gpuvigil demo` does. A message is an alert that reaches a receiver with the
shipped routing (page or ticket): the first message of an incident, or an update of it (a finding
that explains it better, escalates it or is about another GPU of it). The target is one first
message per injected fault (plus updates) and none on a hard negative. Beside it: the messages
the same findings made when every page/ticket finding was its own alert (before incidents).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from typing import Any

COMMAND = "gpuvigil bench incidents"


def measure(res: Any) -> dict[str, Any]:
    """One scenario's figures from its demo result."""
    from gpuvigil.alerts.settings import load_settings
    from gpuvigil.app.demo import oncall_messages

    pushed = set(load_settings().push_severities)
    m = oncall_messages(res)
    return {
        "scenario": res.scenario,
        "faults": len(res.injected),
        # a hard negative (nothing expected: a checkpoint pause, a healthy run) must send nothing
        "negative": not res.expect,
        "findings": len(res.findings),
        "incidents": m["incidents"],
        "first": m["first"],
        "updates": m["updates"],
        "messages": m["messages"],
        "per_finding": sum(1 for f in res.findings if f["severity"] in pushed),
        "ok": res.ok,
    }


def met(row: dict[str, Any]) -> bool:
    """One first message per injected fault (updates allowed); none for a hard negative."""
    if row["negative"]:
        return row["messages"] == 0
    return row["first"] == row["faults"]


def markdown(rows: list[dict[str, Any]], seconds: float) -> str:
    lines = [
        "## Incidents: messages to on-call per injected fault",
        "",
        f"`{COMMAND}` (all built-in scenarios, seed 0), {seconds:.0f} s wall. **Everything here comes from the simulator** "
        "(gpuvigil/sim: 1 Hz samples, faults that start at once and ramp fast): it counts messages, it is no latency figure. "
        "Messages are the alerts that reach a receiver with the shipped routing (alerts/alertmanager.yml: page or ticket), "
        "grouped into incidents by `pipeline.incidents` (gpuvigil/pipeline/incidents.py). Target: one first message per "
        "injected fault, plus updates; none on a hard negative. \"Before\" is one message per page/ticket finding (no incidents).",
        "",
        "| scenario | injected | findings | incidents | first messages | updates | messages | before | target met |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['scenario']} | {'hard negative' if r['negative'] else r['faults']} | {r['findings']} | {r['incidents']} | {r['first']} | {r['updates']} | {r['messages']} | "
            f"{r['per_finding']} | {'met' if met(r) else 'not met'} |"
        )
    faults = sum(r["faults"] for r in rows if not r["negative"])
    total = sum(r["messages"] for r in rows)
    before = sum(r["per_finding"] for r in rows)
    lines += [
        "",
        f"All scenarios: {total} message(s) for {faults} injected fault(s) and {sum(r['negative'] for r in rows)} hard negative(s) ({sum(r['first'] for r in rows)} first, "
        f"{sum(r['updates'] for r in rows)} update(s)); {before} before. Target met in {sum(met(r) for r in rows)}/{len(rows)} scenarios.",
    ]
    return "\n".join(lines) + "\n"


def run(names: list[str], jobs: int) -> list[dict[str, Any]]:
    from gpuvigil.app.demo import run_scenario

    if jobs <= 1:
        return [measure(run_scenario(n)) for n in names]
    # spawn, not fork: a forked child can deadlock on locks polars' threads held.
    with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        return [measure(r) for r in pool.map(run_scenario, names)]


def add_parser(sub) -> None:
    p = sub.add_parser("incidents", help="messages to on-call per injected fault, every built-in scenario (simulated)")
    p.add_argument("--scenario", action="append", default=None, help="only this scenario (repeatable; default: all built-in)")
    p.add_argument("--jobs", type=int, default=1, help="scenarios simulated in parallel (default 1)")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.add_argument("--no-write", action="store_true", help="do not write docs/benchmarks.md")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    import time

    from gpuvigil.sim.scenario import builtin_names

    names = args.scenario or builtin_names()
    t0 = time.monotonic()
    rows = run(names, args.jobs)
    text = markdown(rows, time.monotonic() - t0)
    if not args.no_write and not args.scenario:
        from benchmarks.report import write_section

        write_section("incidents", text)
    print(json.dumps(rows) if args.json else text)
    return 0 if all(met(r) for r in rows) else 1
