"""Shared by the feedback-API tests: a detector that reports a scripted list of findings per
tick, so the real Pipeline (findings lifecycle, hint rules from hints.yaml) feeds the store."""

from __future__ import annotations

from gpuvigil.model import Finding, FindingKind, Severity
from gpuvigil.pipeline.core import Pipeline

TOKEN = "t0k3n-for-tests-0123456789abcdef"


def ecc_finding(node: str = "node-a", gpu: int = 3, ts: float = 100.0, job: str | None = None) -> Finding:
    return Finding(
        kind=FindingKind.ECC,
        severity=Severity.PAGE,
        ts=ts,
        node=node,
        gpu=gpu,
        job=job,
        evidence={"ecc_dbe_volatile_total": 2, "retired_pages_total": 1},
        summary=f"2 double-bit ECC errors on {node} GPU {gpu}",
        source="ecc",
        cause="hardware",
    )


def hang_finding(job: str = "job-7", node: str = "node-b", ts: float = 100.0, culprit_ranks: tuple[int, ...] = (5,)) -> Finding:
    return Finding(
        kind=FindingKind.COLLECTIVE_HANG,
        severity=Severity.PAGE,
        ts=ts,
        job=job,
        node=node,
        ranks=list(range(8)),
        culprit_ranks=list(culprit_ranks),
        evidence={"culprit_nodes": [node], "stuck_seq": 6, "op": "ALLREDUCE"},
        summary=f"rank {culprit_ranks[0]} of {job} never entered ALLREDUCE seq 6",
        source="hang",
        cause="hardware",
    )


def straggler_finding(node: str = "node-c", gpu: int = 1, job: str = "job-9", ts: float = 100.0) -> Finding:
    return Finding(
        kind=FindingKind.STRAGGLER,
        severity=Severity.TICKET,
        ts=ts,
        job=job,
        node=node,
        gpu=gpu,
        culprit_ranks=[2],
        evidence={"slowdown_ratio": 1.8},
        summary=f"rank 2 of {job} on {node} GPU {gpu} is 1.8x slower than the median",
        source="straggler",
    )


class ScriptedDetector:
    """Reports `script[tick_index]` (a list of findings) on each call; nothing after the end."""

    name = "scripted"

    def __init__(self, script: list[list[Finding]]):
        self.script = script
        self.calls = 0

    def detect(self, window) -> list[Finding]:
        out = self.script[self.calls] if self.calls < len(self.script) else []
        self.calls += 1
        return [f.model_copy(update={"ts": window.now}) for f in out]


def pipeline_into(store, script: list[list[Finding]], clear_after: float = 30.0, hint_cooldown: float | None = None) -> Pipeline:
    """The real Pipeline with `store` as its sink; `hint_cooldown` None keeps the configured one."""
    from gpuvigil import config

    pipeline: dict = {"clear_after_seconds": {"default": clear_after, "ecc": clear_after, "nccl_timeout": clear_after}}
    if hint_cooldown is not None:
        pipeline["hint_cooldown_seconds"] = hint_cooldown
    cfg = config.load(overrides={"pipeline": pipeline})
    return Pipeline([], [ScriptedDetector(script)], sinks=[store], cfg=cfg)
