"""Shared by the detector tests: run a scenario file on the simulated cluster, hints off, and
return its findings in a stable, golden-file form."""

from __future__ import annotations

from pathlib import Path
from typing import Any

DATA = Path(__file__).parent / "data" / "detectors" / "scenarios"
GOLDEN = Path(__file__).parent / "data" / "golden" / "findings"

# Evidence keys that are stable enough for golden files (the rest are measured numbers that
# would make every tweak of the simulator's noise a golden-file change).
STABLE_EVIDENCE = ("xid", "xids", "fatal", "silent_ranks", "culprit_nodes", "most_unusual", "remap_failure", "reasons")


def run(name: str, tick_seconds: float = 1.0, seed: int = 0) -> dict[str, Any]:
    from gpuvigil import config
    from gpuvigil.sim import scenario as scenario_mod
    from gpuvigil.app.runtime import build_simulated

    sc = scenario_mod.load(DATA / f"{name}.yaml")
    cfg = config.load(overrides={"pipeline": {"tick_seconds": tick_seconds}, "hints": {"rules": []}})
    rt = build_simulated(sc, seed=seed, cfg=cfg)
    assert rt.cluster is not None
    rt.run(sc.duration_seconds)
    findings = []
    for f in rt.pipeline.all_findings:
        d = f.to_json_dict()
        findings.append(
            {
                "kind": d["kind"],
                "severity": d["severity"],
                "ts": round(d["ts"]),
                "job": d["job"],
                "ranks": d["ranks"],
                "culprit_ranks": d["culprit_ranks"],
                "node": d["node"],
                "gpu": d["gpu"],
                "xid": d["xid"],
                "cause": d["cause"],
                "evidence": {k: d["evidence"][k] for k in STABLE_EVIDENCE if k in d["evidence"]},
            }
        )
    # Findings raised on the same tick come in no particular order.
    findings.sort(key=lambda f: (f["ts"], f["kind"], f["job"] or "", f["node"] or "", f["gpu"] if f["gpu"] is not None else -1))
    return {
        "injected": [f.to_json_dict() for f in rt.cluster.injected],
        "oom_events": rt.cluster.oom_events,
        "findings": findings,
    }


def check_golden(name: str, result: dict[str, Any]) -> None:
    from golden import check_json

    check_json(GOLDEN / f"{name}.json", result)
