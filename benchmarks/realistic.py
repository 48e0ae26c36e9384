"""`gpuvigil bench realistic`: the detector set on the realistic scenarios, where the sources send
what real ones do (gpuvigil/sim/scenarios/realistic/: dcgm-exporter at 30 s, NVML at 1 s, the hook
at step ends or absent, lost and late samples, logs without job names) and faults run on real time
scales (leaks over 10 min to 6 h, fragmentation over hours, stragglers that come and go).

Each scenario runs once, on the full pipeline, with hints off so every fault runs its course (a
leak really ends in an OOM): the table says what gpuvigil raised, how long after the onset, how
long before the OOM, and whether each target is met. It reports what happens, it does not tune
anything: a miss is a row that says "not met".
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

# Targets per expected kind: (what, seconds). A hard negative's target is "no page".
TARGETS = {
    "oom_predicted": ("OOM warned ≥ 60 s before it", 60.0),
    "collective_hang": ("hang found ≤ 60 s", 60.0),
    "xid": ("found ≤ 60 s, naming the job", 60.0),
    "ecc": ("found ≤ 60 s, naming the job", 60.0),
    "thermal_throttle": ("found ≤ 60 s", 60.0),
    "straggler": ("found within its first episode", None),
}


def run_one(name: str, seed: int = 0, sample_interval: float | None = None) -> dict[str, Any]:
    from gpuvigil import config
    from gpuvigil.app.runtime import build_simulated
    from gpuvigil.sim import scenario as scenario_mod

    t0, c0 = time.perf_counter(), time.process_time()
    sc = scenario_mod.load(name)
    if sample_interval is not None:
        sc = scenario_mod.with_sources(sc, device_seconds=sample_interval)
    cfg = config.load(overrides={"hints": {"rules": []}})
    rt = build_simulated(sc, seed=seed, cfg=cfg)
    assert rt.cluster is not None
    rt.run(sc.duration_seconds)
    return {
        "scenario": name,
        "description": sc.description,
        "expect": list(sc.expect),
        "sources": sc.sources.model_dump(),
        "telemetry": sc.telemetry,
        "tick_seconds": rt.tick_seconds,
        "duration_seconds": sc.duration_seconds,
        "faults": [f.model_dump() for f in sc.faults],
        "injected": [f.to_json_dict() for f in rt.cluster.injected],
        "findings": [f.to_json_dict() for f in rt.pipeline.all_findings.every()],
        "oom_events": list(rt.cluster.oom_events),
        "ticks": rt.pipeline.ticks,
        "wall_seconds": time.perf_counter() - t0,
        "cpu_seconds": time.process_time() - c0,
    }


def verdict(run: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per expected kind (or one for a hard negative): what was raised, and the target."""
    rows = []
    if not run["expect"]:
        pages = [f for f in run["findings"] if f["severity"] == "page"]
        rows.append({"kind": "(none)", "target": "no page", "found_after": None, "oom_after": None, "lead": None,
                     "met": not pages, "note": f"{len(run['findings'])} finding(s), {len(pages)} page(s)"})
        return rows
    fault = run["injected"][0] if run["injected"] else None
    onset = fault["ts"] if fault else 0.0
    job = fault["job"] if fault else None
    oom = next((o for o in run["oom_events"] if o["job"] == job), None)
    for kind in run["expect"]:
        found = next((f for f in sorted(run["findings"], key=lambda f: f["ts"]) if f["kind"] == kind and f["job"] == job and f["ts"] >= onset - 1e-9), None)
        what, limit = TARGETS.get(kind, (f"{kind} found", None))
        after = None if found is None else found["ts"] - onset
        lead = None if found is None or oom is None or found["ts"] >= oom["ts"] else oom["ts"] - found["ts"]
        if kind == "oom_predicted":
            met = lead is not None and lead >= (limit or 0)
        elif kind == "straggler":
            lasts = next((f.get("lasts_seconds") for f in run["faults"] if f["type"] == "straggler"), None)
            limit = lasts
            met = after is not None and (lasts is None or after <= lasts)
            what = f"found within its first episode (≤ {lasts:g} s)" if lasts else "found"
        else:
            met = after is not None and (limit is None or after <= limit)
        rows.append({"kind": kind, "target": what, "found_after": after, "oom_after": None if oom is None else oom["ts"] - onset, "lead": lead, "met": met,
                     "note": "" if found is not None else "not raised"})
    return rows


def _sources(run: dict[str, Any]) -> str:
    s = run["sources"]
    dev = f"{run['telemetry']} every {s['device_seconds'] or run['tick_seconds']:g} s ({s.get('device_mode', 'scraped')})"
    hook = "no hook" if s["hook"] == "none" else f"hook {s['hook']}" + (f" ≥ {s['hook_seconds']:g} s" if s["hook"] in ("step", "background") else "")
    extra = []
    if s["drop_share"] or s["late_share"]:
        extra.append(f"{100 * s['drop_share']:.0f}% lost, {100 * s['late_share']:.0f}% late")
    if s["jitter_seconds"]:
        extra.append(f"±{s['jitter_seconds']:g} s jitter")
    if not s["logs_name_job"]:
        extra.append("logs name no job")
    return ", ".join([dev, hook, *extra])


def _fault(run: dict[str, Any]) -> str:
    if not run["faults"]:
        return f"none ({run['duration_seconds'] / 3600:.1f} h)"
    f = run["faults"][0]
    out = f"{f['type']} from {f['at'] / 60:.0f} min" if f["at"] >= 600 else f"{f['type']} from {f['at']:.0f} s"
    if f.get("lasts_seconds"):
        out += f", {f['lasts_seconds'] / 60:.0f} min in every {f['recurs_every_seconds'] / 60:.0f}"
    return out + f" (run {run['duration_seconds'] / 3600:.1f} h)"


def _s(v: float | None) -> str:
    return "–" if v is None else f"{v:,.0f}"


def markdown(runs: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    rows = [(run, v) for run in runs for v in verdict(run)]
    met = sum(v["met"] for _, v in rows)
    lines = [
        "## Detectors on real sample rates and time scales (`gpuvigil bench realistic`)",
        "",
        f"{len(runs)} simulated scenarios (gpuvigil/sim/scenarios/realistic/, seed {meta['seed']}), each once on the full pipeline with hints off so "
        f"every fault runs its course; {meta['sim_hours']:.1f} simulated hours in {meta['ticks']:,} ticks, {meta['cpu_seconds']:.0f} s of CPU. "
        "**Every figure comes from the simulator** (gpuvigil.sim), not from a real cluster: the sources column says what the simulated "
        "instruments sent (device telemetry interval and how it reached the pipeline, the in-process hook, lost/late samples, logs). "
        "One run per scenario: a row is an example, not a rate.",
        "",
        f"Targets met: {met} of {len(rows)}.",
        "",
        "| scenario | sources (simulated) | tick (s) | fault | expected | first finding after onset (s) | OOM after onset (s) | warning lead (s) | target | met |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run, v in rows:
        found = _s(v["found_after"]) if v["found_after"] is not None else (v["note"] or "–")
        lines.append(
            f"| {run['scenario']} | {_sources(run)} | {run['tick_seconds']:g} | {_fault(run)} | {v['kind']} | {found} | {_s(v['oom_after'])} | {_s(v['lead'])} | "
            f"{v['target']} | {'met' if v['met'] else 'not met'} |"
        )
    return "\n".join(lines)


def cmd(args) -> int:
    from gpuvigil.errors import UserError
    from gpuvigil.sim import scenario as scenario_mod

    names = scenario_mod.realistic_names()
    if args.scenarios:
        wanted = [n.strip() for n in args.scenarios.split(",") if n.strip()]
        unknown = [n for n in wanted if n not in names]
        if unknown:
            raise UserError(f"--scenarios: unknown realistic scenario(s) {', '.join(unknown)} (known: {', '.join(names)})")
        names = wanted
    if args.sample_interval is not None:
        if args.sample_interval <= 0:
            raise UserError(f"--sample-interval must be > 0, got {args.sample_interval}")
        for n in names:  # a value a scenario does not take fails before any simulation starts
            scenario_mod.with_sources(scenario_mod.load(n), device_seconds=args.sample_interval)
    workers = max(1, min(len(names), args.workers or os.cpu_count() or 1))
    t0 = time.perf_counter()
    if workers == 1:
        runs = [run_one(n, args.seed, args.sample_interval) for n in names]
    else:
        # spawn, not fork: a forked child of a process whose polars thread pool ran can deadlock.
        with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            runs = list(pool.map(run_one, names, [args.seed] * len(names), [args.sample_interval] * len(names)))
    meta = {
        "seed": args.seed,
        "workers": workers,
        "wall_seconds": time.perf_counter() - t0,
        "cpu_seconds": sum(r["cpu_seconds"] for r in runs),
        "ticks": sum(r["ticks"] for r in runs),
        "sim_hours": sum(r["duration_seconds"] for r in runs) / 3600,
    }
    md = markdown(runs, meta)
    if not args.no_write:
        from benchmarks.report import write_section

        write_section(args.section or "realistic", md, Path(args.output) if args.output else None)
    if args.json:
        out = {"meta": meta, "runs": [{k: r[k] for k in ("scenario", "expect", "sources", "tick_seconds", "ticks")} | {"verdicts": verdict(r)} for r in runs]}
        sys.stdout.write(json.dumps(out, sort_keys=True) + "\n")
    else:
        sys.stdout.write(md + "\n")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("realistic", help="the detectors on the realistic scenarios: real sample rates and fault time scales")
    p.add_argument("--scenarios", default=None, help="comma-separated realistic scenario names (default: all of them)")
    p.add_argument("--seed", type=int, default=0, help="random seed (runs are deterministic per seed)")
    p.add_argument("--sample-interval", type=float, default=None, metavar="SECONDS", help="device telemetry every SECONDS in every scenario (default: each scenario's own)")
    p.add_argument("--workers", type=int, default=None, help="parallel worker processes (default: one per core)")
    p.add_argument("--no-write", action="store_true", help="do not write docs/benchmarks.md")
    p.add_argument("--output", default=None, help="markdown file to write the section into (default docs/benchmarks.md)")
    p.add_argument("--json", action="store_true", help="print the verdicts as one JSON object")
    p.add_argument("--section", default=None, help="docs/benchmarks.md section to write (default: realistic), e.g. realistic-30s for a run with --sample-interval 30")
    p.set_defaults(func=cmd)
