"""The finding kinds' policy table (gpuvigil/kinds.py): every kind has a row, and what the table
says is what routing, identity, clearing and the runbook links do."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gpuvigil import config, kinds
from gpuvigil.alerts.pusher import team_of
from gpuvigil.alerts.settings import HARDWARE_KINDS, load_settings
from gpuvigil.model import Finding, FindingKind, Severity
from gpuvigil.pipeline.core import Pipeline

REPO = Path(__file__).resolve().parents[1]


def test_every_kind_has_a_policy_and_a_runbook_section():
    assert set(kinds.POLICIES) == set(FindingKind)
    anchors = set(re.findall(r'<a id="([^"]+)"></a>', (REPO / "docs" / "runbooks.md").read_text()))
    assert {kinds.runbook_anchor(k) for k in FindingKind} <= anchors


def test_a_hardware_identity_never_names_the_job():
    with pytest.raises(ValueError, match="never the job"):
        kinds.KindPolicy("gpu", "hardware", ("job", "node", "gpu"))
    with pytest.raises(ValueError, match="not finding fields"):
        kinds.KindPolicy("gpu", "hardware", ("node", "slot"))


def _finding(kind: FindingKind, job: str | None = "job-a") -> Finding:
    return Finding(kind=kind, severity=Severity.TICKET, ts=1.0, job=job, node="n1", gpu=2, xid=79 if kind == FindingKind.XID else None,
                   cause="unknown" if kind == FindingKind.ANOMALY else None, evidence={"collector": "dcgm", "target": "http://x"}, summary="s")


@pytest.mark.parametrize("kind", list(FindingKind))
def test_identity_routing_and_clear_time_follow_the_table(kind):
    p = kinds.policy(kind)
    f = _finding(kind)
    moved = f.model_copy(update={"job": "job-b"})
    assert (moved.id == f.id) == ("job" not in p.identity)
    other_gpu = f.model_copy(update={"gpu": 5})
    assert (other_gpu.id == f.id) == (p.identity == ("job",) or all(i.startswith("evidence.") for i in p.identity))
    s = load_settings()
    team = team_of(f, "tenant-x", s)
    expected = {"hardware": s.hardware_team, "platform": s.default_team, "tenant": s.team_of_tenant("tenant-x")}[p.owner]
    assert team == expected
    assert (kind.value in HARDWARE_KINDS) == (p.owner == "hardware")
    pipe = Pipeline([], [], cfg=config.defaults())
    assert pipe._clear_after(f) == (p.clear_after_seconds if p.clear_after_seconds is not None else 30.0)


def test_a_configured_clear_time_overrides_the_table():
    cfg = config.load(overrides={"pipeline": {"clear_after_seconds": {"xid": 5}}})
    assert Pipeline([], [], cfg=cfg)._clear_after(_finding(FindingKind.XID)) == 5.0
    assert Pipeline([], [], cfg=cfg)._clear_after(_finding(FindingKind.ECC)) == 3600.0


def test_fatal_hardware_alerts_default_to_the_fatal_kinds():
    assert sorted(load_settings().fatal_hardware_kinds) == sorted(k.value for k in kinds.FATAL_KINDS) == ["ecc", "row_remap_failure", "xid"]
