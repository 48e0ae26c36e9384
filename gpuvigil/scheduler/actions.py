"""The ordered actions of a scheduling cycle: enqueue → allocate → preempt → backfill.

Each action reads the session and asks the plugins (framework.py). Placements go through a
`Statement`-like check: a plan is complete (every rank has a GPU) and every permit plugin agrees
before `Scheduler.commit` binds it, so a gang is never half placed.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from gpuvigil.scheduler.framework import MILLI, Plan, Session, Statement
from gpuvigil.scheduler.state import Action, Decision

# -- placement search -------------------------------------------------------------------------


def _plain(job) -> bool:
    """No per-job constraint beyond its shape: its failure says the same about larger shapes."""
    s = job.spec
    return not job.excluded_nodes and not job.preferred_nodes and s.min_gpu_memory_bytes == 0


def _shape(job) -> tuple[int, int, int, int, int]:
    s = job.spec
    return (s.n_gpus, s.gpu_milli, s.cpu_milli, s.memory_mib, s.gpus_per_node or 0)


def _dominated(shape: tuple[int, int, int, int, int], failed: list[tuple[int, int, int, int, int]]) -> tuple[int, int, int, int, int] | None:
    """The failed shape that makes this one hopeless too, or None."""
    n, milli, cpu, mem, per = shape
    for f in failed:
        fn, fm, fc, fmem, fper = f
        same_kind = (milli < MILLI) == (fm < MILLI) and (n == 0) == (fn == 0) and per == fper
        if same_kind and n >= fn and milli >= fm and cpu >= fc and mem >= fmem:
            return f
    return None


def node_mask(job, ssn: Session, *, ignore_reservations: bool = False) -> np.ndarray:
    """Nodes the job may use at all: schedulable, passing every filter plugin and not held for
    another job this cycle."""
    mask = ssn.view.schedulable.copy()
    for plugin in ssn.scheduler.plugins.filters:
        mask &= plugin.filter(job, ssn)
    if ssn.reserved is not None and not ignore_reservations and not ssn.backfilling:
        mine = [i for i, holder in ssn.reserved_by.items() if holder == job.spec.name]
        keep = mask[mine].copy()
        mask &= ~ssn.reserved
        mask[mine] = keep
    if ssn.held is not None:
        # Nodes a preemptor's plan counts on while its victims are under notice: no one else
        # (backfill included) takes them, or the eviction frees room the preemptor cannot use.
        mine = [i for i, holder in ssn.held_by.items() if holder == job.spec.name]
        keep = mask[mine].copy()
        mask &= ~ssn.held
        mask[mine] = keep
    return mask


def hold(ssn: Session, job, nodes) -> None:
    """Hold these nodes (names) for a preemptor awaiting its victims, for this session."""
    v = ssn.view
    if ssn.held is None:
        ssn.held = np.zeros(len(v.names), dtype=bool)
    for name in nodes:
        i = v.index.get(name)
        if i is not None:
            ssn.held[i] = True
            ssn.held_by[i] = job.spec.name
    ssn.bump()


def hold_for_preemptors(ssn: Session) -> None:
    for js in ssn.pending:
        if js.awaiting_victims and js.awaiting_nodes:
            hold(ssn, js, js.awaiting_nodes)


def reserve_for(job, ssn: Session) -> list[str]:
    """Hold nodes for a blocked job of a reserving class: the nodes it can use with the most
    idle GPUs, until they could hold the whole job. Other jobs keep the rest of the cluster
    (holding the whole queue behind one gang idles the cluster), and the held nodes fill the
    job as their work ends. Returns the held node names."""
    v, spec = ssn.view, job.spec
    if ssn.reserved is None:
        ssn.reserved = np.zeros(len(v.names), dtype=bool)
    usable = node_mask(job, ssn)
    per = spec.gpus_per_node
    cap = np.minimum(v.n_gpus, per) if per else v.n_gpus
    if per:
        usable &= v.n_gpus >= per
    if spec.n_gpus == 0 or spec.gpu_milli < MILLI:
        order = np.lexsort((np.arange(len(v.names)), -v.free_total))
        need, cap = 1, np.ones(len(v.names), dtype=np.int64)
    else:
        order = np.lexsort((np.arange(len(v.names)), -v.free_whole))
        need = spec.n_gpus
    held: list[int] = []
    got = 0
    for i in order:
        if got >= need:
            break
        if usable[i]:
            held.append(int(i))
            got += int(cap[i])
    if got < need:
        return []  # the cluster cannot hold it now (nodes out of service): reserve nothing
    ssn.reserved[held] = True
    for i in held:
        ssn.reserved_by[i] = job.spec.name
    return [v.names[i] for i in held]


N_ALTERNATIVES = 3  # next best nodes kept in a placement's decision record


def _best(job, ssn: Session, feasible: np.ndarray) -> tuple[tuple[int, ...], dict[str, float], list[dict]] | None:
    """The best option, each score plugin's weighted score there, and the next best nodes."""
    if not feasible.any():
        return None
    total = np.zeros(feasible.shape, dtype=np.float64)
    parts = []
    for plugin, w in ssn.scheduler.plugins.scores:
        if w:
            s = w * plugin.score(job, ssn, feasible)
            total += s
            parts.append((plugin.name, s))
    total[~feasible] = -np.inf
    flat = int(np.argmax(total))  # first maximum: ties go to the lowest node (then GPU) index
    best = np.unravel_index(flat, feasible.shape)
    scores = {name: round(float(s[best]), 6) for name, s in parts}
    per_node = total.max(axis=1) if total.ndim == 2 else total.copy()
    per_node[best[0]] = -np.inf
    alternatives = []
    if per_node.size > 1:
        k = min(N_ALTERNATIVES, per_node.size - 1)
        top = np.argpartition(-per_node, k - 1)[:k] if k > 0 else []
        for i in sorted(top, key=lambda i: (-per_node[i], i)):
            if np.isfinite(per_node[i]):
                alternatives.append({"node": ssn.view.names[int(i)], "score": round(float(per_node[i]), 6)})
    return best, scores, alternatives


def find_plan(job, ssn: Session) -> Plan | None:
    """Where the job would go now, or None; does not change anything."""
    v, spec = ssn.view, job.spec
    mask = node_mask(job, ssn)
    if spec.n_gpus == 0:
        feasible = mask & (v.cpu_free >= spec.cpu_milli) & (v.mem_free >= spec.memory_mib)
        got = _best(job, ssn, feasible)
        return None if got is None else Plan(job, [(int(got[0][0]), -1)], milli=0, scores=got[1], alternatives=got[2])
    if spec.gpu_milli < MILLI:
        host = mask & (v.cpu_free >= spec.cpu_milli) & (v.mem_free >= spec.memory_mib)
        feasible = host[:, None] & (v.free_milli >= spec.gpu_milli)
        got = _best(job, ssn, feasible)
        return None if got is None else Plan(job, [(int(got[0][0]), int(got[0][1]))], milli=spec.gpu_milli, scores=got[1], alternatives=got[2])
    k = spec.n_gpus
    free_whole = v.free_whole
    per = spec.gpus_per_node
    if per is None or per >= k:
        feasible = mask & (free_whole >= k) & (v.cpu_free >= spec.cpu_milli) & (v.mem_free >= spec.memory_mib)
        got = _best(job, ssn, feasible)
        if got is not None:
            n = int(got[0][0])
            gpus = np.flatnonzero(v.free_milli[n] == MILLI)[:k]
            return Plan(job, [(n, int(g)) for g in gpus], scores=got[1], alternatives=got[2])
        if per is not None:
            return None
    planner = ssn.scheduler.plugins.gang_planner
    if planner is None:
        return None
    slots = planner.plan_multi_node(job, ssn, mask & (free_whole > 0))
    if slots is None:
        return None
    nodes = sorted({n for n, _ in slots})
    racks = {int(v.rack[n]) for n in nodes}
    domains = {int(v.domain[n]) for n in nodes}
    where = "one NVLink domain" if len(domains) == 1 else "one rack" if len(racks) == 1 else f"{len(racks)} racks (no single rack had room)"
    return Plan(job, slots, why=f"multi-node gang: {len(nodes)} nodes in {where}, chosen by {planner.name}")


def permitted(plan: Plan, ssn: Session) -> str | None:
    for plugin in ssn.scheduler.plugins.permits:
        reason = plugin.permit(plan.job, plan, ssn)
        if reason:
            return reason
    return None


# -- decision records -------------------------------------------------------------------------


def _node_types(v) -> tuple[np.ndarray, list[str]]:
    """Node type (GPU model x GPUs) code per node and the labels, computed once per view."""
    got = v.__dict__.get("_node_types")
    if got is None:
        labels = [f"{m or 'GPU'} x{int(n)}" for m, n in zip(v.gpu_model, v.n_gpus, strict=True)]
        names = sorted(set(labels))
        code = {x: i for i, x in enumerate(names)}
        got = (np.array([code[x] for x in labels], dtype=np.int64), names)
        v.__dict__["_node_types"] = got
    return got


def diagnose(job, ssn: Session) -> tuple[str, list[dict], str | None]:
    """Why no node takes the job now: (reason, rejected node classes, blocker). Each node is
    counted once, at the first stage that rejects it: node state, then each filter plugin in
    order, then free resources. Computed only when a placement search fails."""
    v, spec = ssn.view, job.spec
    left = np.ones(len(v.names), dtype=bool)
    rejected: list[dict] = []
    type_code, type_names = _node_types(v)

    def take(mask: np.ndarray, stage: str, reason: str) -> None:
        nonlocal left
        hit = left & mask
        if hit.any():
            idx = np.flatnonzero(hit)
            counts = np.bincount(type_code[idx], minlength=len(type_names))
            top = np.argsort(-counts, kind="stable")[:4]
            types = {type_names[int(t)]: int(counts[t]) for t in top if counts[t]}
            rejected.append({"stage": stage, "reason": reason, "nodes": int(idx.size), "node_types": types, "examples": [v.names[int(i)] for i in idx[:3]]})
            left &= ~mask

    down = np.flatnonzero(~v.schedulable)
    if down.size:
        by_state: dict[str, list[int]] = {}
        for i in down:
            by_state.setdefault(v.nodes[int(i)].state, []).append(int(i))
        for state, idx in sorted(by_state.items()):
            mask = np.zeros(len(v.names), dtype=bool)
            mask[idx] = True
            why = v.nodes[idx[0]].reason
            take(mask, "node state", f"{state}" + (f" (e.g. {why})" if why else ""))
    for plugin in ssn.scheduler.plugins.filters:
        explain = getattr(plugin, "reject_reasons", None)
        if explain is not None:
            for mask, why in explain(job, ssn):
                take(mask, f"filter {plugin.name}", why)
        else:
            take(~plugin.filter(job, ssn), f"filter {plugin.name}", f"rejected by {plugin.name}")
    if ssn.reserved is not None and ssn.reserved.any() and not ssn.backfilling:
        holders = sorted({ssn.reserved_by[int(i)] for i in np.flatnonzero(ssn.reserved & left)} - {job.spec.name})
        if holders:
            mine = np.zeros(len(v.names), dtype=bool)
            mine[[i for i, h in ssn.reserved_by.items() if h == job.spec.name]] = True
            take(ssn.reserved & ~mine, "reservation", f"held for {', '.join(holders[:3])} (blocked, reserving class) until it starts")
    if ssn.held is not None and ssn.held.any():
        others = np.array([ssn.held_by.get(i) not in (None, job.spec.name) for i in range(len(v.names))])
        if (others & left).any():
            holders = sorted({ssn.held_by[int(i)] for i in np.flatnonzero(others & left)})
            take(others, "reservation", f"held for {', '.join(holders[:3])} (waiting for its preemption victims)")
    k, per = spec.n_gpus, spec.gpus_per_node
    planner = ssn.scheduler.plugins.gang_planner
    multi = k > 0 and spec.gpu_milli >= MILLI and planner is not None and (per is None or per < k)
    if k > 0 and spec.gpu_milli < MILLI:
        take(~(v.free_milli >= spec.gpu_milli).any(axis=1), "resources", f"no GPU with {spec.gpu_milli / MILLI:.2f} GPU free")
    elif k > 0:
        need = (per or 1) if multi else k
        take(v.free_whole < need, "resources", f"fewer than {need} idle whole GPU(s)")
    if spec.cpu_milli:
        take(v.cpu_free < spec.cpu_milli, "resources", f"less than {spec.cpu_milli / 1000:g} CPUs free")
    if spec.memory_mib:
        take(v.mem_free < spec.memory_mib, "resources", f"less than {spec.memory_mib} MiB memory free")
    fits = int(left.sum())
    held = next((r for r in rejected if r["stage"] == "reservation"), None)
    if held is not None and not fits:
        return (f"no free node outside those held for a reserving job: {held['nodes']} node(s) {held['reason']}", rejected, "reservation by " + held["reason"].split(" (")[0].removeprefix("held for "))
    if multi:
        give = np.where(left, np.minimum(v.free_whole, per) if per else v.free_whole, 0)
        offered = int(give.sum())
        if offered < k:
            shape = f" in blocks of {per} per node" if per else ""
            return (f"gang of {k} GPUs{shape}: the {fits} node(s) that could take part offer {offered}", rejected, "gang")
        return (f"gang of {k} GPUs: {offered} GPUs are free on {fits} node(s) but {planner.name} found no placement", rejected, "gang")
    if fits:
        return (f"{fits} node(s) fit but the placement search found none", rejected, None)
    worst = max(rejected, key=lambda r: r["nodes"]) if rejected else None
    return ("no node can take it" + (f": {worst['nodes']} node(s) {worst['reason']} ({worst['stage']})" if worst else ""), rejected, None)


def record(ssn: Session, job, decision: Decision) -> None:
    ssn.scheduler.decisions.record(job.spec.name, decision)


def record_placed(ssn: Session, plan: Plan, how: str = "placed") -> None:
    v = ssn.view
    nodes = [v.names[n] for n in plan.nodes()]
    if plan.why:
        reason = plan.why
    elif plan.scores:
        top = max(plan.scores.items(), key=lambda kv: abs(kv[1]))
        reason = f"{how} on {nodes[0]}: best total score {sum(plan.scores.values()):.4g} (largest term: {top[0]} {top[1]:.4g})"
    else:
        reason = f"{how} on {', '.join(nodes)}"
    record(ssn, plan.job, Decision(ssn.now, "placed", reason, nodes=nodes, scores=plan.scores, alternatives=plan.alternatives))


def try_place(job, ssn: Session, how: str = "placed") -> bool:
    """Plan, permit, commit; record a failing plain shape so equal or larger ones are skipped.
    Records the decision either way."""
    shape = _shape(job)
    plain = _plain(job)
    if plain:
        dom = _dominated(shape, ssn.unschedulable_shapes)
        if dom is not None:
            other, first = ssn.shape_why.get(dom, (None, None))
            if first is not None:
                record(ssn, job, Decision(ssn.now, "waiting", f"{first.reason} (same or smaller shape as {other}, tried first this cycle)", rejected=first.rejected, blocker=first.blocker))
            return False
    plan = find_plan(job, ssn)
    if plan is None:
        reason, rejected, blocker = diagnose(job, ssn)
        d = Decision(ssn.now, "waiting", reason, rejected=rejected, blocker=blocker)
        record(ssn, job, d)
        if plain:
            ssn.unschedulable_shapes.append(shape)
            ssn.shape_why[shape] = (job.spec.name, d)
        return False
    veto = permitted(plan, ssn)
    if veto:
        blocker = "quota" if "quota" in veto else "gang" if "gang" in veto else "permit"
        record(ssn, job, Decision(ssn.now, "waiting", f"a placement on {', '.join(ssn.view.names[n] for n in plan.nodes()[:4])} was vetoed: {veto}", blocker=blocker))
        return False
    ssn.scheduler.commit(plan, ssn.now)
    ssn.scheduler.sync_view()
    ssn.placed.append(plan)
    ssn.bump()
    record_placed(ssn, plan, how)
    return True


def ordered(jobs, ssn: Session):
    # Guarantees before classes: a job within its tenant's quota goes before any job that would
    # borrow, whatever their classes. Otherwise a high-class borrower takes the room, and the
    # tenant it belongs to reclaims it at once (an eviction for nothing, and the borrower
    # waits again).
    orders = sorted(ssn.scheduler.plugins.orders, key=lambda p: p.name != "quota")

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
            sched._set_state(js, "failed")
            js.end_ts = ssn.now
            sched.actions.append(Action(ssn.now, "failed", job=js.spec.name, detail=f"unschedulable: {reason}"))
            record(ssn, js, Decision(ssn.now, "failed", f"can never run here: {reason}"))
        else:
            admitted.append(js)
    ssn.pending = ordered(admitted, ssn)


def allocate(ssn: Session) -> None:
    """Place pending jobs in order. A blocked job of a reserving class holds nodes for itself
    (`reserve_for`); jobs after it place on the rest of the cluster."""
    reserve = set(ssn.cfg.allocate.reserve_classes)
    hold_for_preemptors(ssn)
    remaining = []
    for js in ssn.pending:
        if js.state != "pending":
            continue
        # A job waiting for preemption victims still takes free room if some appeared (placing
        # it cancels the notices); otherwise preempt finishes it when the grace period ends.
        if not try_place(js, ssn):
            remaining.append(js)
            ssn.blocked.append(js)
            if js.spec.priority in reserve and not js.awaiting_victims:
                held = reserve_for(js, ssn)
                if held:
                    d = ssn.scheduler.decisions.history(js.spec.name)
                    last = d[-1] if d else None
                    reason = (last["reason"] + "; " if last and last["outcome"] == "waiting" else "") + f"holding {len(held)} node(s) for it ({', '.join(held[:4])}{' ...' if len(held) > 4 else ''})"
                    record(ssn, js, Decision(ssn.now, "waiting", reason, nodes=held, rejected=last["rejected"] if last else [], blocker=last["blocker"] if last else None))
                    ssn.bump()
    ssn.pending = remaining


def preempt(ssn: Session) -> None:
    """Evict lower-priority (or borrowed) jobs for blocked jobs that may preempt them."""
    sched = ssn.scheduler
    now = ssn.now
    _end_grace_periods(ssn, now)
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
        grace, via = _victim_graces(js, ssn, plugins)
        if not grace:
            if _plain(js):
                hopeless.setdefault(group, []).append(_shape(js))
            continue
        candidates = _victims_in_order(sched, grace, rank, now)
        plan, chosen = _plan_with_victims(js, candidates, ssn)
        if plan is None:
            if _plain(js):
                hopeless.setdefault(group, []).append(_shape(js))
            continue
        hopeless.clear()
        if not chosen:
            # Room appeared since allocate (an eviction above): no victim needed.
            try_place_unrecorded(js, ssn)
            continue
        _evict_or_give_notice(js, plan, chosen, grace, via, ssn, now)


def _end_grace_periods(ssn: Session, now: float) -> None:
    """Preemptions whose grace period is over, or whose victims all saved a checkpoint since
    their notice (the grace period was for that): the victims go, the preemptor is placed."""
    sched = ssn.scheduler
    early = ssn.cfg.preemption.end_grace_on_checkpoint
    for js in list(ssn.pending):
        if js.awaiting_deadline is None or js.state != "pending":
            continue
        victims = [sched.jobs[v] for v in js.awaiting_victims if sched.jobs[v].state == "running"]
        saved = early and all(_checkpointed_since_notice(v) for v in victims)
        if js.awaiting_deadline <= now or saved:
            js.awaiting_victims, js.awaiting_deadline, js.awaiting_nodes = [], None, []
            for v in victims:
                when = "after its grace period" if not saved or _deadline_passed(v, now) else f"after its checkpoint at t={v.last_checkpoint_ts:.0f}, before the grace period ended"
                v.preempt_deadline, v.preempted_by, v.preempt_notice_ts = None, None, None
                sched._requeue(v, now, f"preempted by {js.spec.name} ({js.spec.priority}; {v.preempt_via}) {when}", kind="preempted")
            sched.sync_view()
            ssn.bump()
            try_place_unrecorded(js, ssn)


def _victim_graces(js, ssn: Session, plugins) -> tuple[dict[str, float], dict[str, str]]:
    """Each running job some preempt plugin offers as a victim of `js`: (its shortest grace, the plugin giving it)."""
    grace: dict[str, float] = {}
    via: dict[str, str] = {}  # victim → the plugin whose (shortest) grace applies
    for p in plugins:
        g = p.grace_seconds(js, ssn)
        for victim in p.victims(js, ssn):
            if victim.state == "running" and victim.preempt_deadline is None and victim is not js:
                name = victim.spec.name
                if g < grace.get(name, float("inf")):
                    grace[name], via[name] = g, p.name
    return grace, via


def _victims_in_order(sched, grace: dict[str, float], rank, now: float) -> list:
    """Victims cheapest first: lowest priority, borrowed, least work since a checkpoint, newest."""
    return sorted(
        (sched.jobs[n] for n in grace),
        key=lambda v: (
            -rank(v.spec.priority),
            not v.borrowed,
            sched.work_since_checkpoint(v, now),
            -(v.start_ts or 0.0),
            v.spec.name,
        ),
    )


def _evict_or_give_notice(js, plan: Plan, chosen: list, grace: dict[str, float], via: dict[str, str], ssn: Session, now: float) -> None:
    """Evict the chosen victims now (no grace), or give them notice and hold their nodes for `js`."""
    sched = ssn.scheduler
    wait = max(grace[v.spec.name] for v in chosen)
    notice = ssn.cfg.preemption.checkpoint_notice_seconds
    if wait <= 0 < notice and any(sched.work_since_checkpoint(v, now) > 0 for v in chosen):
        # "At once" would throw away their work since the last checkpoint: a short notice
        # to save it first (ended by their checkpoint report, see _end_grace_periods).
        wait = notice
    if wait <= 0:
        for v in chosen:
            sched._requeue(v, now, f"preempted by {js.spec.name} ({js.spec.priority}; {via[v.spec.name]}, 0 s grace)", kind="preempted")
        sched.sync_view()
        ssn.bump()
        try_place_unrecorded(js, ssn)
    else:
        js.awaiting_victims = [v.spec.name for v in chosen]
        js.awaiting_deadline = now + wait
        ssn.bump()
        record(
            ssn,
            js,
            Decision(
                now,
                "preempting",
                f"preempting {', '.join(v.spec.name for v in chosen)} ({wait:.0f} s grace, until t={now + wait:.0f})",
                nodes=[ssn.view.names[n] for n in plan.nodes()],
                blocker="victims in their grace period",
            ),
        )
        js.awaiting_nodes = [ssn.view.names[n] for n in plan.nodes()]
        hold(ssn, js, js.awaiting_nodes)
        for v in chosen:
            v.preempt_deadline, v.preempted_by, v.preempt_via, v.preempt_notice_ts = now + wait, js.spec.name, via[v.spec.name], now
            sched.actions.append(
                Action(now, "preempt_notice", job=v.spec.name, detail=f"will be preempted by {js.spec.name} at t={now + wait:.0f} ({wait:.0f} s grace): checkpoint now")
            )


def _checkpointed_since_notice(v) -> bool:
    return v.preempt_notice_ts is not None and v.last_checkpoint_ts is not None and v.last_checkpoint_ts >= v.preempt_notice_ts


def _deadline_passed(v, now: float) -> bool:
    return v.preempt_deadline is not None and v.preempt_deadline <= now


def try_place_unrecorded(js, ssn: Session) -> bool:
    """Place a preemptor on the room its victims left (not recorded as a failed shape)."""
    plan = find_plan(js, ssn)
    if plan is None or permitted(plan, ssn):
        return False
    ssn.scheduler.commit(plan, ssn.now)
    ssn.scheduler.sync_view()
    ssn.placed.append(plan)
    ssn.bump()
    ssn.pending = [p for p in ssn.pending if p is not js]
    record_placed(ssn, plan, "placed after preemption")
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
    remaining = []
    ssn.backfilling = True  # short jobs may use nodes held for a reserving job
    ssn.unschedulable_shapes.clear()  # shapes failed against held nodes may fit now
    ssn.bump()
    try:
        for js in ssn.pending:
            d = js.spec.duration_seconds
            if js.state == "pending" and js.spec.priority not in ssn.cfg.allocate.reserve_classes and d is not None and d <= limit and try_place(js, ssn, "backfilled"):
                continue
            remaining.append(js)
    finally:
        ssn.backfilling = False
    ssn.pending = remaining


ACTIONS: dict[str, Callable[[Session], None]] = {"enqueue": enqueue, "allocate": allocate, "preempt": preempt, "backfill": backfill}
