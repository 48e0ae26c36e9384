"""The ordered actions of a scheduling cycle: enqueue → allocate → preempt → backfill.

Each action reads the session and asks the plugins (framework.py). Placements go through a
`Statement`-like check: a plan is complete (every rank has a GPU) and every permit plugin agrees
before `Scheduler.commit` binds it, so a gang is never half placed.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from gpuvigil.scheduler.framework import MILLI, Plan, Session, Statement

# -- placement search -------------------------------------------------------------------------


def _plain(job) -> bool:
    """No per-job constraint beyond its shape: its failure says the same about larger shapes."""
    s = job.spec
    return not job.excluded_nodes and not job.preferred_nodes and s.min_gpu_memory_bytes == 0


def _shape(job) -> tuple[int, int, int, int, int]:
    s = job.spec
    return (s.n_gpus, s.gpu_milli, s.cpu_milli, s.memory_mib, s.gpus_per_node or 0)


def _dominated(shape: tuple[int, int, int, int, int], failed: list[tuple[int, int, int, int, int]]) -> bool:
    n, milli, cpu, mem, per = shape
    for fn, fm, fc, fmem, fper in failed:
        same_kind = (milli < MILLI) == (fm < MILLI) and (n == 0) == (fn == 0) and per == fper
        if same_kind and n >= fn and milli >= fm and cpu >= fc and mem >= fmem:
            return True
    return False


def node_mask(job, ssn: Session) -> np.ndarray:
    """Nodes the job may use at all: schedulable and passing every filter plugin."""
    mask = ssn.view.schedulable.copy()
    for plugin in ssn.scheduler.plugins.filters:
        mask &= plugin.filter(job, ssn)
    return mask


def _best(job, ssn: Session, feasible: np.ndarray) -> tuple[int, ...] | None:
    if not feasible.any():
        return None
    total = np.zeros(feasible.shape, dtype=np.float64)
    for plugin, w in ssn.scheduler.plugins.scores:
        if w:
            total += w * plugin.score(job, ssn, feasible)
    total[~feasible] = -np.inf
    flat = int(np.argmax(total))  # first maximum: ties go to the lowest node (then GPU) index
    return np.unravel_index(flat, feasible.shape)


def find_plan(job, ssn: Session) -> Plan | None:
    """Where the job would go now, or None; does not change anything."""
    v, spec = ssn.view, job.spec
    mask = node_mask(job, ssn)
    if spec.n_gpus == 0:
        feasible = mask & (v.cpu_free >= spec.cpu_milli) & (v.mem_free >= spec.memory_mib)
        best = _best(job, ssn, feasible)
        return None if best is None else Plan(job, [(int(best[0]), -1)], milli=0)
    if spec.gpu_milli < MILLI:
        host = mask & (v.cpu_free >= spec.cpu_milli) & (v.mem_free >= spec.memory_mib)
        feasible = host[:, None] & (v.free_milli >= spec.gpu_milli)
        best = _best(job, ssn, feasible)
        return None if best is None else Plan(job, [(int(best[0]), int(best[1]))], milli=spec.gpu_milli)
    k = spec.n_gpus
    free_whole = v.free_whole
    per = spec.gpus_per_node
    if per is None or per >= k:
        feasible = mask & (free_whole >= k) & (v.cpu_free >= spec.cpu_milli) & (v.mem_free >= spec.memory_mib)
        best = _best(job, ssn, feasible)
        if best is not None:
            n = int(best[0])
            gpus = np.flatnonzero(v.free_milli[n] == MILLI)[:k]
            return Plan(job, [(n, int(g)) for g in gpus])
        if per is not None:
            return None
    planner = ssn.scheduler.plugins.gang_planner
    if planner is None:
        return None
    slots = planner.plan_multi_node(job, ssn, mask & (free_whole > 0))
    return None if slots is None else Plan(job, slots)


def permitted(plan: Plan, ssn: Session) -> str | None:
    for plugin in ssn.scheduler.plugins.permits:
        reason = plugin.permit(plan.job, plan, ssn)
        if reason:
            return reason
    return None


def try_place(job, ssn: Session) -> bool:
    """Plan, permit, commit; record a failing plain shape so equal or larger ones are skipped."""
    shape = _shape(job)
    plain = _plain(job)
    if plain and _dominated(shape, ssn.unschedulable_shapes):
        return False
    plan = find_plan(job, ssn)
    if plan is None:
        if plain:
            ssn.unschedulable_shapes.append(shape)
        return False
    if permitted(plan, ssn):
        return False
    ssn.scheduler.commit(plan, ssn.now)
    ssn.scheduler.sync_view()
    ssn.placed.append(plan)
    ssn.bump()
    return True


def ordered(jobs, ssn: Session):
    orders = ssn.scheduler.plugins.orders

    def key(js):
        out: tuple = ()
        for p in orders:
            out += p.job_key(js, ssn)
        return out + (js.spec.submit_ts, js.spec.name)

    return sorted(jobs, key=key)


# -- actions ----------------------------------------------------------------------------------


def enqueue(ssn: Session) -> None:
    """Admit pending jobs; a job that can never fit this cluster fails now with the reason."""
    sched = ssn.scheduler
    admitted = []
    for js in ssn.pending:
        reason = None
        if js.spec.n_gpus > sched.total_gpus:
            reason = f"needs {js.spec.n_gpus} GPUs, the cluster has {sched.total_gpus}"
        elif js.spec.gpus_per_node and js.spec.gpus_per_node > ssn.view.max_gpus:
            reason = f"needs {js.spec.gpus_per_node} GPUs per node, the largest node has {ssn.view.max_gpus}"
        if reason:
            from gpuvigil.scheduler.core import Action

            sched._set_state(js, "failed")
            js.end_ts = ssn.now
            sched.actions.append(Action(ssn.now, "failed", job=js.spec.name, detail=f"unschedulable: {reason}"))
        else:
            admitted.append(js)
    ssn.pending = ordered(admitted, ssn)


def allocate(ssn: Session) -> None:
    """Place pending jobs in order; a blocked job of a reserving class holds the queue."""
    reserve = set(ssn.cfg.allocate.reserve_classes)
    remaining = []
    holding = False
    for js in ssn.pending:
        if js.state != "pending":
            continue
        if holding:
            remaining.append(js)
            continue
        # A job waiting for preemption victims still takes free room if some appeared (placing
        # it cancels the notices); otherwise preempt finishes it when the grace period ends.
        if not try_place(js, ssn):
            remaining.append(js)
            ssn.blocked.append(js)
            if js.spec.priority in reserve:
                holding = True
    ssn.pending = remaining


def preempt(ssn: Session) -> None:
    """Evict lower-priority (or borrowed) jobs for blocked jobs that may preempt them."""
    sched = ssn.scheduler
    now = ssn.now
    # First, preemptions whose grace period is over.
    for js in list(ssn.pending):
        if js.awaiting_deadline is not None and js.awaiting_deadline <= now and js.state == "pending":
            victims = [sched.jobs[v] for v in js.awaiting_victims if sched.jobs[v].state == "running"]
            js.awaiting_victims, js.awaiting_deadline = [], None
            for v in victims:
                v.preempt_deadline, v.preempted_by = None, None
                sched._requeue(v, now, f"preempted by {js.spec.name} ({js.spec.priority}) after its grace period", kind="preempted")
            sched.sync_view()
            ssn.bump()
            try_place_unrecorded(js, ssn)
    plugins = sched.plugins.preempts
    if not plugins:
        return
    prio = sched.plugin("priority")
    rank = prio.rank if prio is not None else sched.config.priority.rank
    # A preemptor that found no victims makes equal-or-larger plain jobs of its class and tenant
    # hopeless too (their candidate victims are the same) until something changes.
    hopeless: dict[tuple[str, str], list[tuple[int, int, int, int, int]]] = {}
    for js in list(ssn.blocked):
        if js.state != "pending" or js.awaiting_victims:
            continue
        group = (js.spec.priority, js.spec.tenant)
        if _plain(js) and _dominated(_shape(js), hopeless.get(group, [])):
            continue
        grace: dict[str, float] = {}
        for p in plugins:
            g = p.grace_seconds(js, ssn)
            for victim in p.victims(js, ssn):
                if victim.state == "running" and victim.preempt_deadline is None and victim is not js:
                    name = victim.spec.name
                    grace[name] = min(grace.get(name, g), g)
        if not grace:
            if _plain(js):
                hopeless.setdefault(group, []).append(_shape(js))
            continue
        candidates = sorted(
            (sched.jobs[n] for n in grace),
            key=lambda v: (
                -rank(v.spec.priority),
                not v.borrowed,
                sched.work_since_checkpoint(v, now),
                -(v.start_ts or 0.0),
                v.spec.name,
            ),
        )
        plan, chosen = _plan_with_victims(js, candidates, ssn)
        if plan is None:
            if _plain(js):
                hopeless.setdefault(group, []).append(_shape(js))
            continue
        hopeless.clear()
        wait = max(grace[v.spec.name] for v in chosen)
        from gpuvigil.scheduler.core import Action

        if wait <= 0:
            for v in chosen:
                sched._requeue(v, now, f"preempted by {js.spec.name} ({js.spec.priority})", kind="preempted")
            sched.sync_view()
            ssn.bump()
            try_place_unrecorded(js, ssn)
        else:
            js.awaiting_victims = [v.spec.name for v in chosen]
            js.awaiting_deadline = now + wait
            ssn.bump()
            for v in chosen:
                v.preempt_deadline, v.preempted_by = now + wait, js.spec.name
                sched.actions.append(
                    Action(now, "preempt_notice", job=v.spec.name, detail=f"will be preempted by {js.spec.name} at t={now + wait:.0f} ({wait:.0f} s grace): checkpoint now")
                )


def try_place_unrecorded(js, ssn: Session) -> bool:
    plan = find_plan(js, ssn)
    if plan is None or permitted(plan, ssn):
        return False
    ssn.scheduler.commit(plan, ssn.now)
    ssn.scheduler.sync_view()
    ssn.placed.append(plan)
    ssn.bump()
    ssn.pending = [p for p in ssn.pending if p is not js]
    return True


def _plan_with_victims(js, candidates, ssn: Session):
    """Fewest victims (in candidate order) whose eviction lets the job fit, or (None, [])."""
    v = ssn.view
    stmt = Statement(v)
    taken: list = []
    plan = None
    step = 1
    i = 0
    try:
        while i < len(candidates):
            batch = candidates[i : i + step]
            for victim in batch:
                stmt.give_back(victim)
            taken.extend(batch)
            i += len(batch)
            step *= 2
            plan = find_plan(js, ssn)
            if plan is not None:
                break
        if plan is None:
            return None, []
        # Keep only victims on the nodes the plan uses.
        used_nodes = {v.names[n] for n in plan.nodes()}
        needed = [c for c in taken if any(node in used_nodes for node, _ in c.placement)]
        stmt.discard()
        stmt = Statement(v)
        for victim in needed:
            stmt.give_back(victim)
        plan2 = find_plan(js, ssn)
        if plan2 is not None:
            return plan2, needed
        return plan, taken
    finally:
        stmt.discard()


def backfill(ssn: Session) -> None:
    """Short jobs with a known duration run behind a job that holds the queue."""
    limit = ssn.cfg.backfill.max_duration_seconds
    blocked = {id(js) for js in ssn.blocked}
    remaining = []
    for js in ssn.pending:
        d = js.spec.duration_seconds
        if js.state == "pending" and id(js) not in blocked and d is not None and d <= limit and try_place(js, ssn):
            continue
        remaining.append(js)
    ssn.pending = remaining


ACTIONS: dict[str, Callable[[Session], None]] = {"enqueue": enqueue, "allocate": allocate, "preempt": preempt, "backfill": backfill}
