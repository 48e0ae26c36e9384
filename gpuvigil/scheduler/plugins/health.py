"""Health: acts on gpuvigil's hints and keeps jobs off bad hardware.

- cordon_node / drain_node: no new work on the node (drain: `drained` once empty);
- avoid_gpu: the suspect GPU is never handed out again (its share reads as unavailable);
- requeue_job: the job restarts from its last checkpoint, never again on `exclude_nodes`;
- set_alloc_conf: restart with the allocator setting (e.g. expandable segments);
- resize_or_move_job: move to larger-memory GPUs if the cluster has them, else restart with a
  smaller micro-batch (memory_scale);
- compact: move the listed small jobs to free a whole node for a gang.

As a filter it removes excluded nodes and GPUs with too little memory; as a score it prefers
the nodes a hint asked for (compact targets).
"""

from __future__ import annotations

import numpy as np

from gpuvigil.model import Hint, HintAction
from gpuvigil.scheduler.framework import Session
from gpuvigil.scheduler.state import Action

GIB = 1 << 30


class HealthPlugin:
    name = "health"

    def __init__(self, scheduler):
        self.scheduler = scheduler
        self._all: np.ndarray | None = None

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
