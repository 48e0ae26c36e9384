"""`gpuvigil demo`: every fault scenario end to end on the simulated cluster.

For each scenario: the fault is injected → a detector finds it → the finding is alerted (routed
by severity) → the scheduler acts on the hint → the job resumes. The verdict checks the finding
names the injected job, rank(s) and node, and that hard negatives raise nothing.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from typing import Any

from gpuvigil.sim import scenario as scenario_mod
from gpuvigil.errors import UserError

# Which fields of the injected fault a finding of each kind must name.
_MUST_NAME = {
    "collective_hang": ("job", "culprit_ranks", "node"),
    "straggler": ("job", "culprit_ranks", "node"),
    "xid": ("job", "node", "gpu"),
    "ecc": ("job", "node", "gpu"),
    "row_remap_failure": ("job", "node", "gpu"),
    "thermal_throttle": ("job", "node", "gpu"),
    "oom_predicted": ("job", "ranks"),
    "fragmentation_cluster": ("job",),
}


def alert_route(finding: dict[str, Any], team: str, settings) -> dict[str, Any]:
    """Where Alertmanager sends this finding's alert with the shipped routing (alerts/alertmanager.yml):
    `team` is its incident's (alerts.pusher.incident_teams)."""
    from gpuvigil.alerts.alertmanager_config import NULL_RECEIVER, receiver_name

    severity = finding["severity"]
    pushed = severity in settings.push_severities and severity in ("page", "ticket")
    receiver = receiver_name(team, severity) if pushed else NULL_RECEIVER
    return {
        "finding_id": finding["id"],
        "incident": finding["incident"],
        "update": finding["incident_role"] == "update",
        "severity": severity,
        "team": team,
        "receiver": receiver,
    }


def alerts_of(findings: list[Any], tenants: dict[str, str], settings) -> list[dict[str, Any]]:
    """The alerts the pusher sends for these findings (in the order first raised): one per
    message of an incident (its opening finding and its updates), none for evidence."""
    from gpuvigil.alerts.pusher import incident_teams, is_message, team_of

    teams = incident_teams(findings, tenants, settings)
    return [
        alert_route(f.to_json_dict(), teams.get(f.incident or "") or team_of(f, tenants.get(f.job or "", ""), settings), settings)
        for f in findings
        if is_message(f)
    ]


def oncall_messages(res: ScenarioResult) -> dict[str, int]:
    """What on-call receives in a run: the alerts that reach a receiver (not the blackhole),
    split into first messages of an incident and updates."""
    from gpuvigil.alerts.alertmanager_config import NULL_RECEIVER

    delivered = [a for a in res.alerts if a["receiver"] != NULL_RECEIVER]
    return {
        "messages": len(delivered),
        "first": sum(1 for a in delivered if not a["update"]),
        "updates": sum(1 for a in delivered if a["update"]),
        "incidents": len({f["incident"] for f in res.findings}),
    }


@dataclass
class ScenarioResult:
    scenario: str
    description: str
    seed: int
    nodes: int
    duration_seconds: float
    expect: list[str]
    injected: list[dict[str, Any]]
    findings: list[dict[str, Any]]
    hints: list[dict[str, Any]]
    actions: list[dict[str, Any]]
    alerts: list[dict[str, Any]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    # What the instruments sent (scenario `sources`, the pipeline tick): every run says it.
    sampling: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json_dict(self) -> dict[str, Any]:
        return {
            "scenario": self.scenario,
            "seed": self.seed,
            "nodes": self.nodes,
            "ok": self.ok,
            "problems": self.problems,
            "injected": self.injected,
            "findings": self.findings,
            "alerts": self.alerts,
            "hints": self.hints,
            "actions": self.actions,
            "sampling": self.sampling,
        }


def _fault_value(fault: dict[str, Any], what: str) -> Any:
    return fault.get("ranks") if what == "culprit_ranks" else fault.get(what)


def _names(finding: dict[str, Any], fault: dict[str, Any], what: str) -> bool:
    if what == "culprit_ranks":
        return sorted(finding.get("culprit_ranks") or []) == sorted(fault["ranks"])
    if what == "ranks":
        return set(fault["ranks"]) <= set(finding.get("ranks") or [])
    return finding.get(what) == fault.get(what)


def check(expect: list[str], injected: list[dict[str, Any]], findings: list[dict[str, Any]]) -> list[str]:
    """What is wrong with a run: a missed or misattributed fault, or any finding on a negative."""
    if not expect:
        return [f"unexpected {f['kind']} finding: {f['summary']}" for f in findings]
    problems = []
    for kind in expect:
        candidates = [f for f in findings if f["kind"] == kind]
        if not candidates:
            problems.append(f"no {kind} finding")
            continue
        fields = _MUST_NAME.get(kind, ("job",))
        fault = injected[0] if injected else {}
        fields = tuple(w for w in fields if _fault_value(fault, w) not in (None, []))
        if not any(all(_names(f, fault, w) for w in fields) for f in candidates):
            got = candidates[0]
            problems.append(
                f"{kind} finding names {', '.join(f'{w}={got.get(w)}' for w in fields)} but the fault was "
                + ", ".join(f"{w}={_fault_value(fault, w)}" for w in fields)
            )
    return problems


def sampling_of(sc: scenario_mod.Scenario, tick_seconds: float) -> dict[str, Any]:
    """How the run's sources reported (scenario `sources`), with the pipeline tick it ran at."""
    src = sc.sources
    return {
        "telemetry": sc.telemetry,
        "device_seconds": src.device_seconds if src.device_seconds is not None else tick_seconds,
        "hook": src.hook,
        "hook_seconds": src.hook_seconds,
        "tick_seconds": tick_seconds,
        "drop_share": src.drop_share,
        "late_share": src.late_share,
        "jitter_seconds": src.jitter_seconds,
        "logs_name_job": src.logs_name_job,
    }


def describe_sampling(s: dict[str, Any]) -> str:
    hook = "no hook" if s["hook"] == "none" else "hook every tick" if s["hook"] == "tick" else f"hook {s['hook']} (≥ {s['hook_seconds']:g} s)"
    lossy = f", {100 * s['drop_share']:.0f}% dropped, {100 * s['late_share']:.0f}% late, ±{s['jitter_seconds']:g} s jitter" if s["drop_share"] or s["late_share"] or s["jitter_seconds"] else ""
    logs = "" if s["logs_name_job"] else ", logs without job names"
    return f"simulated: {s['telemetry']} every {s['device_seconds']:g} s{lossy}, {hook}{logs}, tick {s['tick_seconds']:g} s"


def run_scenario(name: str, nodes: int | None = None, seed: int = 0, config_path: str | None = None, sample_interval: float | None = None) -> ScenarioResult:
    from gpuvigil import config
    from gpuvigil.app.runtime import build_simulated

    sc = scenario_mod.load(name)
    if sample_interval is not None:
        sc = scenario_mod.with_sources(sc, device_seconds=sample_interval)
    cfg = config.load(config_path) if config_path else None
    rt = build_simulated(sc, nodes=nodes, seed=seed, cfg=cfg)
    assert rt.cluster is not None
    rt.run(rt.cluster.scenario.duration_seconds)
    from gpuvigil.alerts.settings import load_settings

    raised = list(rt.pipeline.all_findings)
    findings = [f.to_json_dict() for f in raised]
    injected = [f.to_json_dict() for f in rt.cluster.injected]
    settings = load_settings(cfg)
    tenants = {name: js.spec.tenant or "" for name, js in rt.scheduler.jobs.items()}
    return ScenarioResult(
        scenario=sc.name,
        description=sc.description,
        seed=seed,
        nodes=rt.cluster.scenario.nodes,
        duration_seconds=rt.cluster.scenario.duration_seconds,
        expect=list(sc.expect),
        injected=injected,
        findings=findings,
        hints=[h.to_json_dict() for h in rt.pipeline.all_hints],
        actions=[a.to_json_dict() for a in rt.scheduler.actions if a.ts > 0],
        alerts=alerts_of(raised, tenants, settings),
        problems=check(list(sc.expect), injected, findings),
        sampling=sampling_of(sc, rt.tick_seconds),
    )


def _run_one(args: tuple[str, int | None, int, str | None, float | None]) -> ScenarioResult:
    return run_scenario(*args)


def _fmt_ranks(ranks: list[int]) -> str:
    if len(ranks) > 6:
        return f"{ranks[:6]}…({len(ranks)})"
    return str(ranks)


def _incident_places(findings: list[dict[str, Any]]) -> tuple[set[str], set[str]]:
    return {f["job"] for f in findings if f["job"]}, {f["node"] for f in findings if f["node"]}


def render_timelines(res: ScenarioResult) -> list[tuple[str, list[tuple[float, str, str, str]]]]:
    """One timeline per incident: (heading, rows of (ts, stage, style, text)), in the order the
    incidents opened: the fault injected → its findings (each message to on-call, or evidence
    only) → where the messages went → the scheduler's actions → the job resumed. Injected faults
    and actions that touch no incident's job or node come last, under their own heading."""
    onset = min((f["ts"] for f in res.injected), default=None)
    by_incident: dict[str, list[dict[str, Any]]] = {}
    for f in res.findings:
        by_incident.setdefault(f["incident"] or f["id"], []).append(f)
    routes = {a["finding_id"]: a for a in res.alerts}
    hints = {h["id"]: h["finding_id"] for h in res.hints}
    faulted_jobs = {f["job"] for f in res.injected}
    used_faults: set[int] = set()
    used_actions: set[int] = set()
    out: list[tuple[str, list[tuple[float, str, str, str]]]] = []

    def injected_row(f: dict[str, Any]) -> tuple[float, str, str, str]:
        where = f"job={f['job']} ranks={_fmt_ranks(f['ranks'])}" + (f" node={f['node']} gpu={f['gpu']}" if f["node"] else "")
        return (f["ts"], "INJECTED", "bold yellow", f"{f['kind']}  {where}")

    def action_row(a: dict[str, Any]) -> tuple[float, str, str, str]:
        target = a["job"] or a["node"] or ""
        if a["action"] == "avoid_gpu":
            target = f"{a['node']} GPU {a['gpu']}"
        return (a["ts"], "RESUMED" if a["action"] == "placed" else "ACTION", "green", f"{a['action']} {target}: {a['detail']}")

    for incident, findings in by_incident.items():
        rows: list[tuple[float, str, str, str]] = []
        jobs, nodes = _incident_places(findings)
        ids = {f["id"] for f in findings}
        for i, fault in enumerate(res.injected):
            if fault["job"] in jobs or (fault["node"] and fault["node"] in nodes):
                rows.append(injected_row(fault))
                used_faults.add(i)
        for f in findings:
            lat = f" (+{f['ts'] - onset:.0f} s after onset)" if onset is not None and f["ts"] >= onset else ""
            who = f"job={f['job']}" + (f" ranks={_fmt_ranks(f['culprit_ranks'] or f['ranks'])}" if (f["culprit_ranks"] or f["ranks"]) else "")
            who += (f" node={f['node']}" if f["node"] else "") + (f" gpu={f['gpu']}" if f["gpu"] is not None else "")
            role = {"opened": "opens the incident", "update": "updates the incident", "evidence": "evidence, no message"}.get(f["incident_role"] or "", "")
            style = "bold red" if f["severity"] == "page" else "bold magenta" if f["incident_role"] != "evidence" else "dim"
            rows.append((f["ts"], "DETECTED", style, f"{f['kind']} [{f['severity']}] {who}{lat}: {role}\n{f['summary']}"))
            route = routes.get(f["id"])
            if route:
                what = "update" if route["update"] else "message"
                rows.append((f["ts"], "ALERTED", "cyan", f"{what}: {route['severity']} → team {route['team']}, receiver {route['receiver']}"))
        for j, a in enumerate(res.actions):
            if j in used_actions:
                continue
            mine = hints.get(a.get("hint_id") or "") in ids
            resumed = a["action"] == "placed" and a["job"] in faulted_jobs and a["job"] in jobs and any(f["ts"] <= a["ts"] for f in findings)
            if mine or resumed:
                rows.append(action_row(a))
                used_actions.add(j)
        title = next((f for f in reversed(findings) if f["incident_role"] in ("opened", "update")), findings[0])
        messages = sum(1 for f in findings if routes.get(f["id"]))
        heading = f"incident {incident}: {title['kind']} ({len(findings)} finding(s), {messages} alert(s))"
        out.append((heading, _ordered(rows)))
    rest = [injected_row(f) for i, f in enumerate(res.injected) if i not in used_faults]
    rest += [action_row(a) for j, a in enumerate(res.actions) if j not in used_actions and a["action"] != "placed"]
    if rest or not out:
        out.append(("no incident", _ordered(rest)))
    return out


def _ordered(rows: list[tuple[float, str, str, str]]) -> list[tuple[float, str, str, str]]:
    order = {"INJECTED": 0, "DETECTED": 1, "ALERTED": 2, "ACTION": 3, "RESUMED": 4}
    return sorted(rows, key=lambda r: (r[0], order[r[1]]))


def print_text(results: list[ScenarioResult], console) -> None:
    from rich.markup import escape

    for res in results:
        console.print(f"\n[bold]━━ {res.scenario}[/bold] — {escape(res.description)}")
        if res.sampling:
            console.print(f"   ({escape(describe_sampling(res.sampling))})", style="dim")
        for heading, rows in render_timelines(res):
            console.print(f"  [bold]{escape(heading)}[/bold]")
            if not rows:
                console.print("   (no fault injected)")
            for ts, stage, style, text in rows:
                first, *rest = text.split("\n")
                console.print(f"  t={ts:7.1f}s  [{style}]{stage:<9}[/{style}] {escape(first)}")
                for line in rest:
                    console.print(f"                       {escape(line)}", style="dim")
        m = oncall_messages(res)
        console.print(f"  on-call received {m['messages']} message(s): {m['first']} first, {m['updates']} update(s), for {len(res.injected)} injected fault(s)")
        if res.ok:
            verdict = "no finding, as expected" if not res.expect else f"detected {', '.join(res.expect)} naming the right job/rank/node"
            console.print(f"  [bold green]✓ {verdict}[/bold green]")
        else:
            for p in res.problems:
                console.print(f"  [bold red]✗ {escape(p)}[/bold red]")


def cmd_demo(args) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    groups = {"all": scenario_mod.builtin_names, "realistic": scenario_mod.realistic_names}
    names = groups[args.scenario]() if args.scenario in groups else [args.scenario]
    if args.scenario not in groups:
        scenario_mod.load(args.scenario)  # fail fast with a one-line error
    sample_interval = getattr(args, "sample_interval", None)
    if sample_interval is not None:
        if sample_interval <= 0:
            raise UserError(f"--sample-interval must be > 0, got {sample_interval}")
        for name in names:
            scenario_mod.with_sources(scenario_mod.load(name), device_seconds=sample_interval)
    if args.nodes is not None and args.nodes < 1:
        raise UserError(f"--nodes must be >= 1, got {args.nodes}")
    if args.nodes is not None:
        for name in names:  # a size the scenario does not fit fails before any simulation starts
            scenario_mod.with_nodes(scenario_mod.load(name), args.nodes)
    if args.config:
        from gpuvigil import config
        from gpuvigil.app.runtime import build_simulated

        # Build once here so a bad value is reported before any simulation starts.
        build_simulated(names[0], nodes=args.nodes, seed=args.seed, cfg=config.load(args.config))
    jobs = [(n, args.nodes, args.seed, args.config, sample_interval) for n in names]
    err = Console(stderr=True)
    workers = max(1, min(len(jobs), os.cpu_count() or 1, args.jobs or 64))
    results: dict[str, ScenarioResult] = {}
    # On a terminal a progress bar; otherwise (CI logs, `make demo | tee`) one plain line per
    # scenario on stderr, so a minute of simulation is never a minute of silence.
    plain = not err.is_terminal
    started = time.monotonic()

    def done(name: str, res: ScenarioResult) -> None:
        results[name] = res
        progress.advance(task)
        if plain:
            print(f"gpuvigil demo: [{len(results)}/{len(jobs)}] {name} {'ok' if res.ok else 'UNEXPECTED'} ({time.monotonic() - started:.0f} s)", file=sys.stderr, flush=True)

    with Progress(TextColumn("[progress.description]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(), console=err, transient=True, disable=args.json or plain) as progress:
        task = progress.add_task("simulating scenarios", total=len(jobs))
        if plain:
            print(f"gpuvigil demo: simulating {len(jobs)} scenario(s) on {workers} worker(s)...", file=sys.stderr, flush=True)
        if workers == 1:
            for job in jobs:
                done(job[0], _run_one(job))
        else:
            # spawn, not fork: a forked child can deadlock on locks polars' threads held.
            with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn")) as pool:
                futures = {pool.submit(_run_one, job): job[0] for job in jobs}
                for fut in as_completed(futures):
                    done(futures[fut], fut.result())
    ordered = [results[n] for n in names]
    if args.json:
        for res in ordered:
            sys.stdout.write(json.dumps(res.to_json_dict(), sort_keys=True) + "\n")
    else:
        console = Console(highlight=False, soft_wrap=True)
        print_text(ordered, console)
        bad = [r.scenario for r in ordered if not r.ok]
        console.print(f"\n{len(ordered) - len(bad)}/{len(ordered)} scenarios as expected" + (f"; wrong: {', '.join(bad)}" if bad else ""))
    return 0 if all(r.ok for r in ordered) else 1


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="run fault scenarios end to end on the simulated cluster")
    p.add_argument(
        "--scenario",
        default="all",
        help=f"scenario name or file; 'all': the fast built-in ones ({', '.join(scenario_mod.builtin_names())}); "
        f"'realistic': real sample rates and time scales ({', '.join(scenario_mod.realistic_names())})",
    )
    p.add_argument(
        "--sample-interval",
        type=float,
        default=None,
        metavar="SECONDS",
        help="device telemetry every SECONDS per node (30: dcgm-exporter's default, 1: NVML); default: the scenario's (the fast ones: every tick)",
    )
    p.add_argument("--nodes", type=int, default=None, help="override the scenario's node count")
    p.add_argument("--seed", type=int, default=0, help="random seed (runs are deterministic per seed)")
    p.add_argument("--json", action="store_true", help="one JSON object per scenario on stdout")
    p.add_argument("--config", default=None, help="YAML/JSON file overriding thresholds and rules (gpuvigil/config/*.yaml)")
    p.add_argument("--jobs", type=int, default=None, help="scenarios simulated in parallel (default: one per core)")
    p.set_defaults(func=cmd_demo)
