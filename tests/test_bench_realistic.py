"""`gpuvigil bench realistic`: each realistic scenario's verdict per target is computed from what
was raised (met / not met, never asserted as a figure), and the table says it is simulated and
what the simulated sources sent."""

from __future__ import annotations

import json
import subprocess
import sys

from benchmarks.realistic import markdown, verdict


def _run(expect, findings, oom_ts=None, faults=None, injected_ts=600.0):
    return {
        "scenario": "s", "description": "", "expect": expect, "telemetry": "dcgm", "tick_seconds": 30.0, "duration_seconds": 9600.0,
        "sources": {"device_seconds": 30.0, "device_mode": "scraped", "hook": "none", "hook_seconds": 1.0, "drop_share": 0.0, "late_share": 0.0,
                    "late_seconds": (5.0, 60.0), "jitter_seconds": 0.0, "logs_name_job": True},
        "faults": faults if faults is not None else [{"type": "memory_leak", "at": injected_ts, "lasts_seconds": None}],
        "injected": [{"kind": "memory_leak", "ts": injected_ts, "job": "train", "ranks": [3], "node": "n", "gpu": 3}] if expect else [],
        "findings": findings,
        "oom_events": [] if oom_ts is None else [{"ts": oom_ts, "job": "train", "rank": 3, "node": "n", "gpu": 3, "cause": "capacity"}],
        "ticks": 320, "wall_seconds": 1.0, "cpu_seconds": 1.0,
    }


def _f(kind, ts, severity="page", job="train"):
    return {"kind": kind, "ts": ts, "job": job, "severity": severity}


def test_an_oom_warning_meets_its_target_only_60_s_ahead():
    [v] = verdict(_run(["oom_predicted"], [_f("oom_predicted", 5000.0)], oom_ts=7800.0))
    assert v["met"] and v["lead"] == 2800.0 and v["found_after"] == 4400.0 and v["oom_after"] == 7200.0
    [v] = verdict(_run(["oom_predicted"], [_f("oom_predicted", 7770.0)], oom_ts=7800.0))
    assert not v["met"] and v["lead"] == 30.0
    # Raised about another job, or only after the OOM: not a warning of this one.
    [v] = verdict(_run(["oom_predicted"], [_f("oom_predicted", 5000.0, job="other"), _f("oom_predicted", 7900.0)], oom_ts=7800.0))
    assert not v["met"] and v["lead"] is None
    [v] = verdict(_run(["oom_predicted"], [], oom_ts=7800.0))
    assert not v["met"] and v["note"] == "not raised"


def test_a_hard_negative_meets_its_target_without_a_page():
    assert verdict(_run([], [_f("anomaly", 100.0, severity="ticket")]))[0]["met"]
    assert not verdict(_run([], [_f("collective_hang", 100.0)]))[0]["met"]


def test_an_intermittent_straggler_must_be_found_within_its_first_episode():
    faults = [{"type": "straggler", "at": 600.0, "lasts_seconds": 300.0, "recurs_every_seconds": 1200.0}]
    assert verdict(_run(["straggler"], [_f("straggler", 800.0, severity="ticket")], faults=faults))[0]["met"]
    assert not verdict(_run(["straggler"], [_f("straggler", 1900.0, severity="ticket")], faults=faults))[0]["met"]


def test_the_table_says_simulated_and_computes_met(tmp_path):
    runs = [_run(["oom_predicted"], [], oom_ts=7800.0), _run([], [])]
    md = markdown(runs, {"seed": 0, "sim_hours": 5.3, "ticks": 640, "cpu_seconds": 2.0})
    assert "**Every figure comes from the simulator**" in md and "Targets met: 1 of 2." in md
    table = [line for line in md.splitlines() if line.startswith("|")]
    assert all(len(r.split("|")) == len(table[0].split("|")) for r in table)
    assert "| dcgm every 30 s (scraped), no hook |" in table[2] and table[2].endswith("| not met |") and table[3].endswith("| met |")


def test_cli_runs_a_scenario_and_writes_its_section(tmp_path):
    doc = tmp_path / "b.md"
    proc = subprocess.run(
        [sys.executable, "-m", "gpuvigil", "bench", "realistic", "--scenarios", "xid79_logs_without_job", "--json", "--output", str(doc)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    [run] = out["runs"]
    assert run["scenario"] == "xid79_logs_without_job" and run["sources"]["logs_name_job"] is False
    [v] = run["verdicts"]
    assert v["kind"] == "xid" and isinstance(v["met"], bool)
    text = doc.read_text()
    assert "<!-- bench:realistic:start -->" in text and "| xid79_logs_without_job | nvml every 1 s (scraped), hook step ≥ 1 s, 5% lost, 10% late, logs name no job |" in text
    for args, message in ((["--scenarios", "nope"], "unknown realistic scenario"), (["--sample-interval", "0"], "--sample-interval must be > 0")):
        bad = subprocess.run([sys.executable, "-m", "gpuvigil", "bench", "realistic", *args], capture_output=True, text=True, timeout=120)
        assert bad.returncode == 2 and message in bad.stderr and "Traceback" not in bad.stderr
