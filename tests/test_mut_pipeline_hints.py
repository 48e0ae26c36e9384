"""Findings → hints through the shipped rule table (gpuvigil/pipeline/hints.py), on the cases the
fast tests did not reach (mutation testing, docs/testing.md): an action that needs a job
or a GPU on a finding that lacks one, and the fields a hint copies from its finding.

Data: constructed findings (kind, job, node, gpu as a detector would set them); the rules are the
shipped defaults (`config.defaults()["hints"]`), not a test table.
"""

from __future__ import annotations

from gpuvigil import config
from gpuvigil.model import Finding, FindingKind, HintAction, Severity
from gpuvigil.pipeline.hints import HintPolicy


def _finding(kind: FindingKind, **kw) -> Finding:
    return Finding(kind=kind, severity=Severity.PAGE, ts=100.0, summary="s", **kw)


def test_a_node_action_is_kept_and_a_job_action_dropped_for_a_finding_without_a_job():
    """A fatal XID on a node with no job known: the rule's cordon_node is issued for the node;
    its requeue_job has nothing to act on and is dropped."""
    hints = HintPolicy(config.defaults()).hints_for(_finding(FindingKind.XID, node="h200-0", gpu=3, xid=79, evidence={"fatal": True}))
    assert [(h.action, h.node, h.job) for h in hints] == [(HintAction.CORDON_NODE, "h200-0", None)]


def test_job_actions_carry_the_findings_job_node_gpu_and_reason():
    """A hardware hang of job j on two culprit nodes: cordon the finding's node, requeue the job
    away from both culprit nodes; every hint names the finding's job, node, gpu, id and kind."""
    f = _finding(FindingKind.COLLECTIVE_HANG, cause="hardware", job="j", node="n1", gpu=2, evidence={"culprit_nodes": ["n2", "n1", "n2"]})
    hints = HintPolicy(config.defaults()).hints_for(f)
    assert [h.action for h in hints] == [HintAction.CORDON_NODE, HintAction.REQUEUE_JOB]
    for h in hints:
        assert (h.job, h.node, h.gpu, h.finding_id, h.finding_kind, h.ts) == ("j", "n1", 2, f.id, FindingKind.COLLECTIVE_HANG, 100.0)
        assert h.reason == "collective_hang: s"
    assert hints[0].exclude_nodes == [] and hints[1].exclude_nodes == ["n1", "n2"]


def test_avoid_gpu_needs_both_a_node_and_a_gpu():
    """A straggler's avoid_gpu: issued for (node, gpu); a finding that knows the node but not the
    GPU, or the GPU but not the node, gets none."""
    policy = HintPolicy(config.defaults())
    assert [(h.action, h.node, h.gpu) for h in policy.hints_for(_finding(FindingKind.STRAGGLER, job="j", node="n1", gpu=5))] == [(HintAction.AVOID_GPU, "n1", 5)]
    assert policy.hints_for(_finding(FindingKind.STRAGGLER, job="j", node="n1")) == []
    assert policy.hints_for(_finding(FindingKind.STRAGGLER, job="j", gpu=5)) == []


def test_requeue_excludes_the_findings_node_when_no_culprit_node_is_named():
    """A hardware hang whose evidence has an empty culprit_nodes list: the requeue avoids the
    finding's own node (an empty list names nobody)."""
    f = _finding(FindingKind.COLLECTIVE_HANG, cause="hardware", job="j", node="n1", evidence={"culprit_nodes": []})
    hints = HintPolicy(config.defaults()).hints_for(f)
    assert [(h.action, h.exclude_nodes) for h in hints] == [(HintAction.CORDON_NODE, []), (HintAction.REQUEUE_JOB, ["n1"])]


def test_an_action_dropped_for_want_of_a_job_does_not_drop_the_rules_later_actions():
    """An operator's rule (rules are data) that lists requeue_job before cordon_node: on a finding
    without a job the requeue is dropped and the cordon still issued."""
    cfg = {"hints": {"rules": [{"kind": "xid", "actions": ["requeue_job", "cordon_node"]}], "faults": []}}
    hints = HintPolicy(cfg).hints_for(_finding(FindingKind.XID, node="h200-0", gpu=3, xid=79))
    assert [(h.action, h.node) for h in hints] == [(HintAction.CORDON_NODE, "h200-0")]
