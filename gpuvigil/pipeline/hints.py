"""Findings → scheduler hints, by a rule table (config section `hints`).

The first rule whose `kind`, `cause`, `severity` and `match` (evidence key → value) all fit a
finding decides its hints. Rules are data so an operator can, say, stop auto-cordoning on XID 13
without touching code.

Before any hint, `classify` says whose fault a finding is (the `faults` table, first match wins):
`user` (the application's own: an OOM of its own memory, a hang whose culprit rank is the
program, an XID under that job only: its owner is told, nothing is cordoned) or `infrastructure`
(the GPU, node or network: the hardware team). A detector that knows better (the XID detector's
per-GPU job history) sets `evidence["fault"]` itself, and the table leaves it alone.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from gpuvigil import config
from gpuvigil.model import Finding, FindingKind, Hint, HintAction


class HintRule(BaseModel):
    kind: FindingKind
    cause: str | None = None
    severity: str | None = None
    match: dict[str, Any] = Field(default_factory=dict)
    actions: list[HintAction]
    exclude_culprit_node: bool = True
    params: dict[str, Any] = Field(default_factory=dict)


FAULT_WORDS = {
    "user": "User fault: the application's own, its owner is told.",
    "infrastructure": "Infrastructure fault: the GPU, node or network, not the application.",
}


class FaultRule(BaseModel):
    kind: FindingKind
    cause: str | None = None
    match: dict[str, Any] = Field(default_factory=dict)
    fault: Literal["user", "infrastructure"]


class HintConfig(BaseModel):
    rules: list[HintRule]
    faults: list[FaultRule]


class HintPolicy:
    def __init__(self, cfg: dict[str, Any] | None = None):
        self.config = config.section("hints", HintConfig, cfg)

    def rule_for(self, finding: Finding) -> HintRule | None:
        for rule in self.config.rules:
            if rule.kind != finding.kind:
                continue
            if rule.cause is not None and rule.cause != finding.cause:
                continue
            if rule.severity is not None and rule.severity != finding.severity.value:
                continue
            if any(finding.evidence.get(k) != v for k, v in rule.match.items()):
                continue
            return rule
        return None

    def classify(self, finding: Finding) -> str | None:
        """Say whose fault `finding` is, in its evidence (`fault`) and summary; returns it."""
        if "fault" in finding.evidence:
            return finding.evidence["fault"]  # type: ignore[return-value]
        for rule in self.config.faults:
            if rule.kind != finding.kind or (rule.cause is not None and rule.cause != finding.cause):
                continue
            if any(finding.evidence.get(k) != v for k, v in rule.match.items()):
                continue
            # A new evidence mapping: a finding copied from another (model_copy is shallow) must
            # not hand its verdict to the original, whose summary would then never say it.
            finding.evidence = {**finding.evidence, "fault": rule.fault}
            finding.summary = f"{finding.summary.rstrip()} {FAULT_WORDS[rule.fault]}"
            return rule.fault
        return None

    def hints_for(self, finding: Finding) -> list[Hint]:
        rule = self.rule_for(finding)
        if rule is None:
            return []
        if finding.kind == FindingKind.COMPONENT_FAULT:
            return self._component_hints(finding, rule)
        hints = []
        for action in rule.actions:
            params: dict[str, Any] = dict(rule.params.get(action.value, {}))
            exclude: list[str] = []
            if action == HintAction.REQUEUE_JOB and rule.exclude_culprit_node:
                culprit_nodes = finding.evidence.get("culprit_nodes")
                if isinstance(culprit_nodes, list) and culprit_nodes:
                    exclude = sorted({str(n) for n in culprit_nodes})
                elif finding.node:
                    exclude = [finding.node]
            if action == HintAction.COMPACT and "moves" in finding.evidence:
                params["moves"] = finding.evidence["moves"]
            if action in (HintAction.REQUEUE_JOB, HintAction.SET_ALLOC_CONF, HintAction.RESIZE_OR_MOVE_JOB) and not finding.job:
                continue  # job-level action without a job: nothing to act on
            if action in (HintAction.CORDON_NODE, HintAction.DRAIN_NODE) and not finding.node:
                continue
            if action == HintAction.AVOID_GPU and (finding.node is None or finding.gpu is None):
                continue
            hints.append(
                Hint(
                    action=action,
                    ts=finding.ts,
                    reason=f"{finding.kind.value}: {finding.summary}",
                    finding_id=finding.id,
                    finding_kind=finding.kind,
                    job=finding.job,
                    node=finding.node,
                    gpu=finding.gpu,
                    exclude_nodes=exclude,
                    params=params,
                )
            )
        return hints

    def _component_hints(self, finding: Finding, rule: HintRule) -> list[Hint]:
        """A named component is taken out as one action: one hint per node it drains, all with the
        same `component_action` (the component finding's id) so that a breaker counts them once."""
        nodes = [str(n) for n in finding.evidence.get("drain_nodes") or []]  # type: ignore[union-attr]
        component = f"{finding.evidence.get('level')}:{finding.evidence.get('component')}"
        hints = []
        for action in rule.actions:
            if action not in (HintAction.CORDON_NODE, HintAction.DRAIN_NODE):
                continue
            for node in nodes:
                params = {**rule.params.get(action.value, {}), "component": component, "component_action": finding.id, "component_nodes": nodes}
                hints.append(Hint(action=action, ts=finding.ts, reason=f"{finding.kind.value}: {finding.summary}", finding_id=finding.id, finding_kind=finding.kind, node=node, params=params))
        return hints
