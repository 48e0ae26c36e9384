"""`gpuvigil bench incidents`: its figures come from the demo's result and its "met" is computed,
one first message per injected fault (plus updates), none on a hard negative."""

from __future__ import annotations

import pytest

from benchmarks.incidents import markdown, measure, met
from gpuvigil.app.demo import ScenarioResult


def result(injected: int, alerts: list[tuple[str, str, bool]], findings: list[tuple[str, str, str]]) -> ScenarioResult:
    """alerts: (incident, receiver, update); findings: (incident, severity, role)."""
    return ScenarioResult(
        scenario="s", description="", seed=0, nodes=1, duration_seconds=1.0, expect=["x"] if injected else [], hints=[], actions=[],
        injected=[{"kind": "x", "ts": 1.0, "job": "j", "ranks": [0], "node": "n", "gpu": 0}] * injected,
        findings=[{"id": f"f{i}", "incident": inc, "severity": sev, "incident_role": role} for i, (inc, sev, role) in enumerate(findings)],
        alerts=[{"finding_id": f"f{i}", "incident": inc, "receiver": rcv, "update": upd, "severity": "ticket", "team": "t"}
                for i, (inc, rcv, upd) in enumerate(alerts)],
    )


@pytest.mark.parametrize(
    "injected, alerts, findings, expected",
    [
        # thermal_throttle: opened by an anomaly, re-titled (an update), the straggler evidence
        (1, [("a", "r-ticket", False), ("a", "r-ticket", True)], [("a", "ticket", "opened"), ("a", "ticket", "update"), ("a", "ticket", "evidence")],
         dict(first=1, updates=1, messages=2, incidents=1, per_finding=3, met=True)),
        # two incidents for one fault: not met
        (1, [("a", "r-ticket", False), ("b", "r-ticket", False)], [("a", "ticket", "opened"), ("b", "ticket", "opened")],
         dict(first=2, updates=0, messages=2, incidents=2, per_finding=2, met=False)),
        # an info finding goes to the blackhole: no message, so the fault was not told: not met
        (1, [("a", "blackhole", False)], [("a", "info", "opened")], dict(first=0, updates=0, messages=0, incidents=1, per_finding=0, met=False)),
        # a hard negative with nothing raised: met; with a message: not met
        (0, [], [], dict(first=0, updates=0, messages=0, incidents=0, per_finding=0, met=True)),
        (0, [("a", "r-page", False)], [("a", "page", "opened")], dict(first=1, updates=0, messages=1, incidents=1, per_finding=1, met=False)),
    ],
)
def test_figures_and_target(injected, alerts, findings, expected):
    row = measure(result(injected, alerts, findings))
    assert row["negative"] is (injected == 0)
    assert {k: row[k] for k in ("first", "updates", "messages", "incidents", "per_finding")} == {k: v for k, v in expected.items() if k != "met"}
    assert met(row) is expected["met"]
    text = markdown([row], 1.0)
    assert "comes from the simulator" in text and "1 Hz" in text
    assert text.count("| not met |") == (0 if expected["met"] else 1)


def test_a_hard_negative_with_a_fault_injected_must_send_nothing():
    """checkpoint_pause injects a pause that is no fault (nothing expected): silence is the target."""
    res = result(1, [], [])
    res.expect = []
    row = measure(res)
    assert row["negative"] and met(row)
    res.alerts = [{"finding_id": "f0", "incident": "a", "receiver": "r-ticket", "update": False, "severity": "ticket", "team": "t"}]
    assert not met(measure(res))
    assert "| hard negative |" in markdown([row], 1.0)
