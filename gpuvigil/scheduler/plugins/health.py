"""Health: acts on gpuvigil's hints and keeps jobs off bad hardware.

- cordon_node / drain_node: no new work on the node (drain: `drained` once empty);
- avoid_gpu: the suspect GPU is never handed out again (its share reads as unavailable);
- requeue_job: the job restarts from its last checkpoint, never again on `exclude_nodes`;
- set_alloc_conf: restart with the allocator setting (e.g. expandable segments);
- resize_or_move_job: move to larger-memory GPUs if the cluster has them, else restart with a
  smaller micro-batch (memory_scale);
- compact: move the listed small jobs to free a whole node for a gang.

Every hint first passes the circuit breaker (`acting.breaker`): over its limits it opens, and no
hint applies until it is closed (`close_breaker`).

As a filter it removes excluded nodes and GPUs with too little memory; as a score it prefers
the nodes a hint asked for (compact targets).
"""

from __future__ import annotations

import numpy as np

from gpuvigil.model import Hint, HintAction
from gpuvigil.scheduler.quarantine import Breaker, QuarantineStore
from gpuvigil.scheduler.framework import Session
from gpuvigil.scheduler.state import Action

GIB = 1 << 30


class HealthPlugin:
    name = "health"

    def __init__(self, scheduler):
        self.scheduler = scheduler
        self._all: np.ndarray | None = None
        # The circuit breaker of every acting path (gpuvigil.scheduler.quarantine), in memory: over its
        # limits no hint applies, each held hint is an action ("breaker_held"), and the trip
        # itself is one ("breaker_open", the page's text), until `close_breaker`.
        self.breaker = Breaker(QuarantineStore(":memory:"), getattr(scheduler, "breaker_config", None), scope="builtin")

    def close_breaker(self, who: str, now: float) -> None:
        self.breaker.close(who=who, now=now)
        self.scheduler.actions.append(Action(now, "breaker_closed", detail=f"closed by {who}: hints apply again"))

    def _admitted(self, hint: Hint, now: float, emit) -> bool:
        """Ask the breaker before a hint takes a node or GPU out of service; while it is open no
        hint applies. Each hint held is an action of its own."""
        sched = self.scheduler
        act = hint.action
        if not self.breaker.cfg.enabled:
            return True
        out = act in (HintAction.CORDON_NODE, HintAction.DRAIN_NODE, HintAction.AVOID_GPU) and hint.node in sched.nodes
        if out and not self.breaker.is_open:
            ns = sched.nodes[hint.node]
            if act == HintAction.AVOID_GPU:
                if hint.gpu is None or hint.gpu in ns.avoid_gpus:
                    return True
                key, nodes, gpus = f"{hint.node}/{hint.gpu}", 0, 1
            else:
                if ns.state != "up":
                    return True
                key, nodes, gpus = hint.node, 1, ns.spec.n_gpus
            if self.breaker.admit(key, nodes=nodes, gpus=gpus, fleet_nodes=len(sched.nodes), fleet_gpus=sched.total_gpus, now=now, cause=hint.finding_kind.value):
                return True
            page = self.breaker.page_due()
            if page is not None:
                emit(Action(now, "breaker_open", detail=page, hint_id=hint.id))
        elif not self.breaker.is_open:
            return True
        elif out:
            key = hint.node if act != HintAction.AVOID_GPU else f"{hint.node}/{hint.gpu}"
            self.breaker.admit(key, nodes=0 if act == HintAction.AVOID_GPU else 1, gpus=1 if act == HintAction.AVOID_GPU else sched.nodes[hint.node].spec.n_gpus,
                               fleet_nodes=len(sched.nodes), fleet_gpus=sched.total_gpus, now=now, cause=hint.finding_kind.value)
        target = f"node {hint.node}" if hint.node and act in (HintAction.CORDON_NODE, HintAction.DRAIN_NODE, HintAction.AVOID_GPU) else f"job {hint.job}"
        emit(Action(now, "breaker_held", job=hint.job, node=hint.node if out else None, gpu=hint.gpu if act == HintAction.AVOID_GPU else None,
                    detail=f"breaker open: {act.value} on {target} not applied ({hint.finding_kind.value}: {hint.reason})", hint_id=hint.id))
        return False

    # -- hooks ----------------------------------------------------------------------------------
    def filter(self, job, ssn: Session) -> np.ndarray:
        v = ssn.view
        if not job.excluded_nodes and not job.spec.min_gpu_memory_bytes:
            if self._all is None or len(self._all) != len(v.names):
                self._all = np.ones(len(v.names), dtype=bool)
                self._all.flags.writeable = False
            return self._all
        mask = np.ones(len(v.names), dtype=bool)
        if job.excluded_nodes:
            idx = [v.index[n] for n in job.excluded_nodes if n in v.index]
            mask[idx] = False
        if job.spec.min_gpu_memory_bytes:
            mask &= v.gpu_memory >= job.spec.min_gpu_memory_bytes
        return mask

    def reject_reasons(self, job, ssn: Session) -> list[tuple[np.ndarray, str]]:
        """The filter split by cause, for decision records."""
        v = ssn.view
        out = []
        if job.excluded_nodes:
            mask = np.zeros(len(v.names), dtype=bool)
            mask[[v.index[n] for n in job.excluded_nodes if n in v.index]] = True
            out.append((mask, "excluded for this job (it failed or hung there; requeued away by a hint)"))
        if job.spec.min_gpu_memory_bytes:
            out.append((v.gpu_memory < job.spec.min_gpu_memory_bytes, f"GPU memory below {job.spec.min_gpu_memory_bytes / GIB:.0f} GiB (resize/move hint)"))
        return out

    def score(self, job, ssn: Session, feasible: np.ndarray) -> np.ndarray:
        s = np.zeros(feasible.shape[0])
        if job.preferred_nodes:
            idx = [ssn.view.index[n] for n in job.preferred_nodes if n in ssn.view.index]
            s[idx] = 1.0
        return s[:, None] + np.zeros(feasible.shape) if feasible.ndim == 2 else s

    # -- hints ----------------------------------------------------------------------------------
    def apply_hint(self, hint: Hint, now: float) -> list:
        sched = self.scheduler
        out: list[Action] = []

        def emit(a: Action) -> None:
            out.append(a)
            sched.actions.append(a)

        if not self._admitted(hint, now, emit):
            return out
        act = hint.action
        if act in (HintAction.CORDON_NODE, HintAction.DRAIN_NODE) and hint.node in sched.nodes:
            ns = sched.nodes[hint.node]
            if ns.state == "up":
                if act == HintAction.CORDON_NODE:
                    ns.state = "cordoned"
                else:
                    ns.state = "draining" if ns.jobs() else "drained"
                ns.reason = hint.reason
                emit(Action(now, "cordoned" if act == HintAction.CORDON_NODE else "drained", node=hint.node, detail=hint.reason, hint_id=hint.id))
        elif act == HintAction.AVOID_GPU and hint.node in sched.nodes and hint.gpu is not None:
            ns = sched.nodes[hint.node]
            if hint.gpu not in ns.avoid_gpus:
                ns.avoid_gpus.add(hint.gpu)
                emit(Action(now, "avoid_gpu", node=hint.node, gpu=hint.gpu, detail=f"GPU marked suspect: {hint.reason}", hint_id=hint.id))
        elif act == HintAction.REQUEUE_JOB and hint.job in sched.jobs:
            js = sched.jobs[hint.job]
            js.excluded_nodes |= set(hint.exclude_nodes)
            if js.state == "running":
                out.append(sched._requeue(js, now, hint.reason, hint.id))
        elif act == HintAction.SET_ALLOC_CONF and hint.job in sched.jobs:
            js = sched.jobs[hint.job]
            conf = str(hint.params.get("alloc_conf", "expandable_segments:True"))
            if js.alloc_conf != conf:
                js.alloc_conf = conf
                emit(Action(now, "set_alloc_conf", job=hint.job, detail=f"PYTORCH_CUDA_ALLOC_CONF={conf}", hint_id=hint.id))
                if js.state == "running":
                    out.append(sched._requeue(js, now, f"restart with PYTORCH_CUDA_ALLOC_CONF={conf}", hint.id))
        elif act == HintAction.RESIZE_OR_MOVE_JOB and hint.job in sched.jobs:
            js = sched.jobs[hint.job]
            current = max((sched.nodes[n].spec.gpu_memory_bytes for n, _ in js.placement), default=0)
            larger = [ns for ns in sched.nodes.values() if ns.spec.gpu_memory_bytes > current and ns.schedulable]
            if larger:
                js.spec.min_gpu_memory_bytes = min(ns.spec.gpu_memory_bytes for ns in larger)
                detail = f"move to GPUs with >= {js.spec.min_gpu_memory_bytes / GIB:.0f} GiB"
            else:
                js.memory_scale *= 0.75
                detail = f"no larger-memory GPU free: restart with micro-batch x{js.memory_scale:.2f}"
            emit(Action(now, "resized", job=hint.job, detail=detail, hint_id=hint.id))
            if js.state == "running":
                out.append(sched._requeue(js, now, detail, hint.id))
        elif act == HintAction.COMPACT:
            for move in hint.params.get("moves", []):
                js = sched.jobs.get(str(move.get("job")))
                target = move.get("to_node")
                if js is None or js.state != "running":
                    continue
                js.preferred_nodes = [target] if target else []
                emit(Action(now, "moved", job=js.spec.name, node=target, detail=f"compact: move from {move.get('from_node')} to {target}", hint_id=hint.id))
                out.append(sched._requeue(js, now, "compact to free a gang slot", hint.id))
                # Re-place the moved job right away so the freed slot goes to the gang job.
                sched.sync_view()
                # Placement search lives in `actions`, above the plugins: ask the scheduler.
                ssn = Session(now=now, scheduler=sched, view=sched.view, pending=[js])
                plan = sched.find_plan(js, ssn)
                if plan is not None and not sched.permitted(plan, ssn):
                    sched.commit(plan, now)
                    sched.sync_view()
        return out
