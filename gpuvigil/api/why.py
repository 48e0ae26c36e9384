"""`GET /v1/jobs/{job}/why`: the built-in scheduler's decision records for one job (why it was
placed where it is, or why it waits), for on-call engineers and `gpuvigil why JOB`.

The API does not import the scheduler: whoever builds the app (`gpuvigil serve`) hands it a
callable `why(job) -> dict | None` (`gpuvigil.scheduler.core.Scheduler.why`). An app without one
(`gpuvigil api --db`, which serves a hint store only) answers 404 with that explanation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, HTTPException
from pydantic import BaseModel, Field

WhyProvider = Callable[[str], "dict[str, Any] | None"]

NO_SCHEDULER = "no built-in scheduler runs behind this API (`gpuvigil serve --api-port` serves decisions; `gpuvigil api --db` serves hints only)"


class RejectedNodes(BaseModel):
    stage: str = Field(description="'node state', 'filter <plugin>' or 'resources': where these nodes were ruled out")
    reason: str
    nodes: int = Field(description="how many nodes")
    node_types: dict[str, int] = Field(description="node type (GPU model x GPUs) → count")
    examples: list[str]


class DecisionRecord(BaseModel):
    ts: float = Field(description="the latest cycle that decided this (pipeline clock, seconds)")
    first_ts: float = Field(description="the first cycle of this run of equal decisions")
    cycles: int = Field(description="cycles in a row that decided the same")
    outcome: str = Field(description="placed | waiting | preempting | failed")
    reason: str
    nodes: list[str]
    scores: dict[str, float] = Field(description="for a placement: each score plugin's weighted score at the chosen option")
    alternatives: list[dict[str, Any]] = Field(description="for a placement: the next best nodes and their total scores")
    rejected: list[RejectedNodes] = Field(description="for a wait: the node classes ruled out, each at its first rejecting stage")
    blocker: str | None = Field(description="what holds the job besides the nodes: quota, gang, a reservation, victims in their grace period")


class JobWhy(BaseModel):
    job: str
    state: str = Field(description="pending | running | completed | failed | cancelled")
    summary: str
    tenant: str
    priority: str
    n_gpus: int
    gpu_milli: int
    gpus_per_node: int | None
    placement: list[tuple[str, int]] = Field(description="rank → (node, GPU); GPU -1 for a CPU-only task")
    restarts: int
    preemptions: int
    excluded_nodes: list[str]
    decisions: list[DecisionRecord] = Field(description="oldest first, bounded; equal consecutive decisions merged")
    recent_actions: list[dict[str, Any]] = Field(description="the job's latest scheduler actions (placed, requeued, preempted ...)")


def add_why_route(router: APIRouter, why: WhyProvider | None) -> None:
    @router.get("/jobs/{job}/why", response_model=JobWhy, tags=["scheduler"], responses={404: {"description": "no scheduler here, or it does not know the job"}})
    def job_why(job: str) -> Any:
        """Why the built-in scheduler placed the job where it is (plugin scores, next best nodes),
        or why it waits (the node state, filter or resource that ruled out each node class; the
        quota, gang, reservation or preemption holding it), per cycle."""
        if why is None:
            raise HTTPException(404, NO_SCHEDULER)
        got = why(job)
        if got is None:
            raise HTTPException(404, f"the scheduler does not know job {job!r}")
        return got
