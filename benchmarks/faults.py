"""`gpuvigil bench faults`: the fault study of acting with guards.

A simulated cluster runs training gangs on gpuvigil's own scheduler (`gpuvigil.scheduler`, the
real code), at an offered load where queues are stable (80% by default), while the real node
faults and repairs of the InfiniteHBD trace (584 faults on 231 servers over 349 days) arrive. Two
scenarios, each run on the same seeds, arm against arm (a seed fixes the workload, the mapping of
the trace's nodes onto the cluster and the storm's nodes, so the arms' differences are paired):

- **trace**: the real faults only; operators alone (watchdog timeouts, a node drained after
  repeated job failures) against gpuvigil acting on its hints through the circuit breaker;
- **storm**: the same, plus a mass XID storm (a bad driver rollout: a fatal XID on 60% of the
  nodes within two minutes, the GPUs working on); gpuvigil acting without a breaker against
  gpuvigil acting through it (`acting.breaker` defaults; a person closes it an hour after its page).

Reported per arm (mean over seeds): GPU-hours lost, node-hours out of service and the peak of
nodes out at once, the breaker's trips, overall and P0 queue p95; and for each pair the mean
paired difference with its 95% confidence interval (Student t over the seeds).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.scheduler import DEFAULT_FAULTS, FaultSimParams, Storm, fault_sim, load_faults
from gpuvigil.errors import UserError
from gpuvigil.model import Hint
from gpuvigil.scheduler.quarantine import Breaker, BreakerConfig, QuarantineStore, acting_config

REPO = Path(__file__).resolve().parent.parent
# The full public trace beside the repository (shared/traces, see its README), else the excerpt.
SHARED = [REPO.parent / "shared" / "traces" / "infinitehbd-faults", REPO.parent.parent / "shared" / "traces" / "infinitehbd-faults"]

# Student t 0.975 quantiles by degrees of freedom (1..30); normal beyond.
_T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]

METRICS = (
    ("gpu_hours_lost", "GPU-hours lost", "{:.0f}"),
    ("node_hours_out_of_service", "node-hours out of service", "{:.0f}"),
    ("nodes_out_of_service_peak", "nodes out at once (peak)", "{:.0f}"),
    ("breaker_trips", "breaker trips", "{:.1f}"),
    ("queue_p95_hours", "queue p95 (h)", "{:.2f}"),
    ("p0_queue_p95_hours", "P0 queue p95 (h)", "{:.2f}"),
)


class BreakerGate:
    """The circuit breaker as the simulation's gate on node-taking hints (gpuvigil.scheduler.quarantine's
    Breaker, in memory, on simulated time). A person closes it `close_after_hours` after it opened
    (on the next request after that); what it held back is not replayed."""

    def __init__(self, cfg: BreakerConfig, fleet_nodes: int, gpus_per_node: int, close_after_hours: float = 1.0):
        self.breaker = Breaker(QuarantineStore(":memory:"), cfg, scope="sim")
        self.fleet_nodes, self.gpus_per_node = fleet_nodes, gpus_per_node
        self.close_after_s = close_after_hours * 3600.0
        self.openings: list[dict[str, Any]] = []

    def __call__(self, hint: Hint, now: float, takes_a_node: bool) -> bool:
        st = self.breaker.state()
        if st.open and st.opened_at is not None and now >= st.opened_at + self.close_after_s:
            self.openings[-1]["would_have_nodes"] = st.would_have_nodes
            self.breaker.close(who="operator (simulated)", now=now)
        was_open = self.breaker.state().open
        if not takes_a_node:
            return not was_open  # open: every action is dry-run
        ok = self.breaker.admit(str(hint.node), nodes=1, gpus=self.gpus_per_node, fleet_nodes=self.fleet_nodes,
                                fleet_gpus=self.fleet_nodes * self.gpus_per_node, now=now, cause=hint.finding_kind.value)
        if not ok and not was_open:
            self.openings.append({"day": now / 86400.0, "page": self.breaker.page_due(), "would_have_nodes": 1})
        return ok

    def finish(self) -> dict[str, Any]:
        st = self.breaker.state()
        if st.open and self.openings:
            self.openings[-1]["would_have_nodes"] = st.would_have_nodes
        return {"breaker_trips": st.trips, "breaker_openings": self.openings}


def t975(df: int) -> float:
    return _T975[df - 1] if 1 <= df <= len(_T975) else 1.96


def paired(a: list[float], b: list[float]) -> dict[str, float]:
    """Mean of b - a over the seeds and its 95% confidence interval (Student t)."""
    d = np.asarray(b, float) - np.asarray(a, float)
    n = d.size
    mean = float(d.mean())
    half = float(t975(n - 1) * d.std(ddof=1) / math.sqrt(n)) if n > 1 else math.inf
    return {"mean": mean, "low": mean - half, "high": mean + half, "n": n}


def one_run(faults, params: FaultSimParams, *, hints: bool, breaker: BreakerConfig | None, storm: Storm | None, close_after_hours: float) -> dict[str, Any]:
    gate = BreakerGate(breaker, params.nodes, params.gpus_per_node, close_after_hours) if breaker is not None else None
    r = fault_sim(faults, params, hints=hints, gate=gate, storm=storm)
    out = {k: r[k] for k in ("gpu_hours_lost", "node_hours_out_of_service", "nodes_out_of_service_peak", "queue_p95_hours", "jobs_submitted",
                             "jobs_completed", "faults_injected", "storm_nodes", "storm_nodes_cordoned", "storm_jobs_requeued", "restarts")}
    out["p0_queue_p95_hours"] = r["by_class"].get("P0", {}).get("queue_p95_hours", 0.0)
    out.update(gate.finish() if gate is not None else {"breaker_trips": 0, "breaker_openings": []})
    return out


ARMS = {
    "trace": (("operators", False, False), ("gpuvigil + breaker", True, True)),
    "storm": (("gpuvigil, no breaker", True, False), ("gpuvigil + breaker", True, True)),
}


def study(faults_dir: Path, *, nodes: int, days: float, load: float, seeds: int, storm_day: float, close_after_hours: float = 1.0,
          cfg: dict[str, Any] | None = None) -> dict[str, Any]:
    faults = [f for f in load_faults(faults_dir) if f.day <= days]
    ids = sorted({f.node_id for f in faults})
    if len(ids) > nodes:
        keep = set(ids[:nodes])
        faults = [f for f in faults if f.node_id in keep]
    bcfg = acting_config(cfg).breaker
    storm = Storm(day=storm_day)
    res: dict[str, Any] = {"params": {"nodes": nodes, "gpus_per_node": 8, "days": days, "load": load, "seeds": seeds, "storm_day": storm_day,
                                      "storm_share": storm.share, "storm_spread_seconds": storm.spread_seconds, "storm_xid": storm.xid,
                                      "storm_return_hours": storm.return_hours, "close_after_hours": close_after_hours,
                                      "breaker": bcfg.model_dump(), "trace_nodes": len({f.node_id for f in faults}),
                                      "trace_faults": sum(1 for f in faults if f.start)},
                           "scenarios": {}}
    for scenario, arms in ARMS.items():
        runs: dict[str, list[dict[str, Any]]] = {}
        for name, hints, with_breaker in arms:
            runs[name] = [
                one_run(faults, FaultSimParams(nodes=nodes, days=days, load=load, seed=seed), hints=hints, breaker=bcfg if with_breaker else None,
                        storm=storm if scenario == "storm" else None, close_after_hours=close_after_hours)
                for seed in range(seeds)
            ]
        (a, _, _), (b, _, _) = arms
        res["scenarios"][scenario] = {
            "arms": {name: {k: float(np.mean([r[k] for r in rs])) for k, _, _ in METRICS} | {"runs": rs} for name, rs in runs.items()},
            "paired": {k: paired([r[k] for r in runs[a]], [r[k] for r in runs[b]]) for k, _, _ in METRICS},
            "pair": [a, b],
        }
    res["limits"] = Breaker(QuarantineStore(":memory:"), bcfg).limits(nodes, nodes * 8)
    return res


def targets(res: dict[str, Any]) -> list[tuple[str, str, str, bool | None]]:
    storm = res["scenarios"]["storm"]
    trace = res["scenarios"]["trace"]
    lim_nodes = res["limits"][0]
    with_b = storm["arms"]["gpuvigil + breaker"]["runs"]
    no_b = storm["arms"]["gpuvigil, no breaker"]["runs"]
    took = max(r["storm_nodes_cordoned"] for r in with_b)
    trips_storm = [r["breaker_trips"] for r in with_b]
    trips_trace = sum(r["breaker_trips"] for r in trace["arms"]["gpuvigil + breaker"]["runs"])
    lost = storm["paired"]["gpu_hours_lost"]
    return [
        ("storm: nodes the storm took out through the breaker", f"<= its cap ({lim_nodes})", f"{took} (no breaker: {max(r['storm_nodes_cordoned'] for r in no_b)})", took <= lim_nodes),
        ("storm: the breaker trips in every seed", ">= 1", f"{min(trips_storm)}-{max(trips_storm)}", min(trips_storm) >= 1),
        ("real faults only: breaker trips (it must not stop gpuvigil on real faults)", "0", f"{trips_trace} in {len(trace['arms']['gpuvigil + breaker']['runs'])} seeds", trips_trace == 0),
        ("storm: GPU-hours lost, breaker minus no breaker", "< 0, CI below 0", f"{lost['mean']:+.0f} [{lost['low']:+.0f}, {lost['high']:+.0f}]", lost["high"] < 0),
    ]


def markdown(res: dict[str, Any], cmd: str) -> str:
    from benchmarks.report import provenance, targets_table

    p = res["params"]
    b = p["breaker"]
    lines = [
        "## Fault study: acting with the circuit breaker (trace-driven simulation)",
        "",
        provenance(
            cmd,
            f"real node fault arrivals and repairs from the InfiniteHBD trace (github.com/stepfun-ai/InfiniteHBD-Trace: {p['trace_faults']} faults on "
            f"{p['trace_nodes']} servers in days 0-{p['days']:g}), each trace node mapped onto a random simulated node per seed. "
            "**From the simulator**: the cluster "
            f"({p['nodes']} nodes x {p['gpus_per_node']} GPUs), the workload (training gangs of 8-256 GPUs, Poisson arrivals at {p['load']:.0%} offered "
            "load, lognormal durations of median 24 h, checkpoints every 60 min, P0/P1/P2 10/30/60%), gpuvigil's detection (a finding 10-30 s after "
            "a fault, drawn; no telemetry is sampled: an event simulation at the level of findings, no sample rate), the operators without gpuvigil "
            "(NCCL watchdog after 600 s, a node drained after 2 job failures), and the storm: "
            f"a fatal XID {p['storm_xid']} on {p['storm_share']:.0%} of the nodes within {p['storm_spread_seconds']:.0f} s on day {p['storm_day']:g}, "
            f"the GPUs working on (a bad driver rollout's or a detector bug's false alarm), what it took out returned by a person "
            f"{p['storm_return_hours']:g} h later. The scheduler, the hint rules and the breaker are gpuvigil's own code "
            f"(`acting.breaker`: at most {b['max_node_fraction']:.0%} of nodes and {b['max_nodes']} nodes in {b['window_seconds']:.0f} s, "
            f"so {res['limits'][0]} nodes here; a person closes it {p['close_after_hours']:g} h after its page). {p['seeds']} seeds, paired arm against arm.",
        ),
        "",
    ]
    for scenario, title in (("trace", "Real faults only"), ("storm", "Real faults and a mass XID storm")):
        sc = res["scenarios"][scenario]
        a, bb = sc["pair"]
        lines += [f"{title} (mean over seeds; difference {bb} minus {a}, with its 95% paired confidence interval):", "",
                  f"| figure | {a} | {bb} | difference [95% CI] |", "| --- | ---: | ---: | ---: |"]
        for key, label, fmt in METRICS:
            d = sc["paired"][key]
            ci = f"{d['mean']:+.2f} [{d['low']:+.2f}, {d['high']:+.2f}]" if math.isfinite(d["low"]) else f"{d['mean']:+.2f} (one seed: no interval)"
            lines.append(f"| {label} | {fmt.format(sc['arms'][a][key])} | {fmt.format(sc['arms'][bb][key])} | {ci} |")
        spread = ", ".join(f"{name} {min(r['queue_p95_hours'] for r in sc['arms'][name]['runs']):.1f}-{max(r['queue_p95_hours'] for r in sc['arms'][name]['runs']):.1f} h"
                           for name in (a, bb))
        lines += ["", f"Queue p95 from seed to seed (is the queue stable at this load?): {spread}.", ""]
        if scenario == "storm":
            runs = sc["arms"]["gpuvigil + breaker"]["runs"]
            cordoned = [r["storm_nodes_cordoned"] for r in runs]
            nob = [r["storm_nodes_cordoned"] for r in sc["arms"]["gpuvigil, no breaker"]["runs"]]
            pages = [o["page"] for r in runs for o in r["breaker_openings"] if o.get("page")]
            held = [sum(o["would_have_nodes"] for o in r["breaker_openings"]) for r in runs]
            lines += [f"Storm nodes (per seed, {runs[0]['storm_nodes']} hit): cordoned without a breaker {min(nob)}-{max(nob)}, through the breaker "
                      f"{min(cordoned)}-{max(cordoned)}, while it was open it held back {min(held)}-{max(held)} more (dry-run); its one page, "
                      f"sent as it opened (first seed): \"{pages[0] if pages else 'none'}\"", ""]
    lines += targets_table(targets(res))
    return "\n".join(lines)


def add_parser(sub) -> None:
    p = sub.add_parser("faults", help="fault study: GPU-hours lost, nodes out, breaker trips in a mass XID storm, queue p95 with paired CIs")
    p.add_argument("--faults", type=Path, default=None, help="InfiniteHBD fault trace folder (default: shared/traces beside the repository, else the excerpt)")
    p.add_argument("--nodes", type=int, default=240, help="simulated nodes (>= the trace's nodes used; default 240)")
    p.add_argument("--days", type=float, default=90.0, help="days of the trace replayed (default 90)")
    p.add_argument("--load", type=float, default=0.7, help="offered load, share of GPU capacity (default 0.7: queue p95 within hours across seeds; at 0.8 it spread 0.6-28 h on this cluster)")
    p.add_argument("--seeds", type=int, default=10, help="seeds (default 10)")
    p.add_argument("--storm-day", type=float, default=None, help="day of the XID storm (default: the middle of --days)")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    p.add_argument("--no-write", action="store_true", help="do not write docs/benchmarks.md")
    p.set_defaults(func=main)


def main(args) -> int:
    from benchmarks.report import command, write_section

    faults = args.faults or next((d for d in SHARED if d.is_dir()), DEFAULT_FAULTS)
    if not (faults / "fault_trace.json").is_file():
        raise UserError(f"{faults}: no fault_trace.json (pass --faults DIR, the infinitehbd-faults folder)")
    if args.seeds < 2:
        raise UserError("--seeds must be >= 2 (a paired interval needs two)")
    if args.nodes < 8 or args.days < 1 or not 0 < args.load <= 1.5:
        raise UserError("--nodes >= 8, --days >= 1 and 0 < --load <= 1.5")
    storm_day = args.storm_day if args.storm_day is not None else args.days / 2
    if not 0 <= storm_day < args.days:
        raise UserError("--storm-day must fall within --days")
    res = study(faults, nodes=args.nodes, days=args.days, load=args.load, seeds=args.seeds, storm_day=storm_day)
    md = markdown(res, command("faults"))
    if not args.no_write:
        write_section("faults", md)
    print(json.dumps(res, default=float) if args.json else md)
    return 0
