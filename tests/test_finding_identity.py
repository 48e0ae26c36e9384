"""A finding's identity (`Finding.id`, the cause key): what makes two findings the same cause.

A device's own faults belong to the device: the same GPU handed to another job is the same
finding (one alert, one set of hints). An anomaly's cause is part of what it is: a PCIe replay
finding and the learned model's anomaly on one GPU are two findings, neither overwriting the other.
"""

from __future__ import annotations

import pytest

from gpuvigil.model import Finding, FindingKind, Severity


def finding(kind: FindingKind, **over) -> Finding:
    base = {"kind": kind, "severity": Severity.PAGE, "ts": 100.0, "job": "job-a", "node": "node-1", "gpu": 3, "summary": "s"}
    return Finding(**{**base, **over})


@pytest.mark.parametrize(
    ("kind", "extra"),
    [(FindingKind.XID, {"xid": 79}), (FindingKind.ECC, {}), (FindingKind.THERMAL_THROTTLE, {})],
)
def test_a_device_fault_is_the_same_finding_whichever_job_holds_the_gpu(kind, extra):
    first = finding(kind, job="job-a", **extra)
    assert finding(kind, job="job-b", ts=500.0, **extra).id == first.id
    assert finding(kind, job=None, **extra).id == first.id  # a kernel line that names no job
    assert finding(kind, job="job-a", gpu=4, **extra).id != first.id
    assert finding(kind, job="job-a", node="node-2", **extra).id != first.id


def test_two_xids_on_one_gpu_are_two_findings():
    assert finding(FindingKind.XID, xid=79).id != finding(FindingKind.XID, xid=94).id


def test_a_pcie_replay_finding_does_not_collide_with_the_model_anomaly_on_the_same_gpu():
    pcie = finding(FindingKind.ANOMALY, severity=Severity.TICKET, cause="pcie_replay")
    learned = finding(FindingKind.ANOMALY, severity=Severity.TICKET, cause="unknown")
    assert pcie.id != learned.id
    assert finding(FindingKind.ANOMALY, cause="pcie_replay", ts=900.0).id == pcie.id


@pytest.mark.parametrize("kind", [FindingKind.STRAGGLER, FindingKind.ANOMALY])
def test_a_rank_level_finding_still_belongs_to_its_job(kind):
    assert finding(kind, job="job-a").id != finding(kind, job="job-b").id


def test_job_level_causes_follow_the_job_across_nodes():
    a = finding(FindingKind.COLLECTIVE_HANG, node="node-1", gpu=3)
    assert finding(FindingKind.COLLECTIVE_HANG, node="node-7", gpu=0, ts=999.0).id == a.id


# -- the kinds table, end to end --------------------------------------------------------------------


class _Counters:
    """One GPU's PCIe replay counter, growing 300 a minute, and its job's placement."""

    name = "counters"
    errors = 0
    streams: dict = {}

    def collect(self, now: float) -> dict:
        from gpuvigil import schemas

        return {
            "gpu_samples": schemas.frame([{"ts": now, "node": "node-1", "gpu": 3, "pcie_replay_total": int(5 * now)}], schemas.GPU_SAMPLES),
            "allocations": schemas.frame([{"job": "job-a", "rank": 0, "node": "node-1", "gpu": 3}], schemas.ALLOCATIONS),
        }


class _LearnedAnomaly:
    """The learned model's anomaly on the same GPU, every tick."""

    name = "anomaly_stub"
    streams = ("gpu_samples",)

    def detect(self, window) -> list[Finding]:
        return [finding(FindingKind.ANOMALY, severity=Severity.INFO, ts=window.now, cause="unknown")]


def test_a_pcie_replay_finding_and_an_anomaly_on_one_gpu_both_stay_and_the_link_gets_its_hint():
    from gpuvigil import config
    from gpuvigil.alerts.pusher import team_of
    from gpuvigil.alerts.settings import load_settings
    from gpuvigil.detectors.pcie import PcieReplayDetector
    from gpuvigil.model import HintAction
    from gpuvigil.pipeline.core import Pipeline

    cfg = config.defaults()
    pipe = Pipeline([_Counters()], [PcieReplayDetector(cfg), _LearnedAnomaly()], cfg=cfg)
    results = [pipe.tick(float(t)) for t in range(0, 70)]
    kinds = sorted(f.kind.value for f in pipe.active.values())
    assert kinds == ["anomaly", "pcie_replay"]
    [pcie] = [f for f in pipe.active.values() if f.kind == FindingKind.PCIE_REPLAY]
    hints = [h for r in results for h in r.new_hints]
    assert [(h.action, h.node, h.finding_id) for h in hints] == [(HintAction.CORDON_NODE, "node-1", pcie.id)]
    # A device's fault: the hardware team's, however the tenant's team is set up.
    settings = load_settings(cfg)
    assert team_of(pcie, "some-tenant", settings) == settings.hardware_team
    assert pcie.id == pcie.model_copy(update={"job": "job-b"}).id
