"""The built-in scheduler: queue, all-or-nothing gang placement, preemption and quota reclaim,
requeue from checkpoint, cordon/drain, and the hints gpuvigil feeds it.

Public surface used by the simulator, the demo and the pipeline (keep it stable):
`submit`, `cycle`, `apply_hint`, `checkpoint`, `job_failed`, `job_completed`, `placements`,
`state_frames`, `on_tick` (a pipeline sink), `actions` (everything it did, in order).
Added: `cancel`, `node_down`, `uncordon`, `lost_gpu_seconds`, `plugins`.

The cycle is a framework (gpuvigil/scheduler/framework.py): a session snapshot, ordered actions
(gpuvigil/scheduler/actions.py) and policy plugins (gpuvigil/scheduler/plugins/), configured
by the `scheduler` config section.
"""

from __future__ import annotations

from itertools import islice
from typing import Any

import polars as pl

from gpuvigil import schemas
from gpuvigil.model import Hint
from gpuvigil.scheduler.quarantine import acting_config
from gpuvigil.util.recentlog import RecentLog
from gpuvigil.scheduler import actions as actions_mod
from gpuvigil.scheduler.config import SchedulerConfig, load_scheduler_config
from gpuvigil.scheduler.framework import MILLI, ClusterView, Plan, Session
from gpuvigil.scheduler.plugins import build_plugins
from gpuvigil.scheduler.state import GIB, Action, DecisionLog, JobSpec, JobState, NodeSpec, NodeState  # noqa: F401  (re-exported)


class Scheduler:
    MAX_PASSES = 3  # passes of one cycle: the first, plus one per round of evictions
    def __init__(self, nodes: list[NodeSpec], cfg: dict[str, Any] | SchedulerConfig | None = None):
        names = [n.name for n in nodes]
        if len(set(names)) != len(names):
            raise ValueError("node names must be unique")
        self.config: SchedulerConfig = load_scheduler_config(cfg)
        # The health plugin's circuit breaker: the `acting` section of a whole config, defaults
        # otherwise (a SchedulerConfig alone says nothing about acting).
        self.breaker_config = acting_config(None if isinstance(cfg, SchedulerConfig) else cfg).breaker
        self._dirty: set[str] = set()
        self.nodes: dict[str, NodeState] = {}
        for spec in nodes:
            ns = NodeState(spec)
            object.__setattr__(ns, "_sink", self._dirty)
            self.nodes[spec.name] = ns
        self.view = ClusterView(list(self.nodes.values()))
        self._dirty.clear()
        self._evicted = 0  # preemptions so far (a cycle runs another pass after any)
        self.jobs: dict[str, JobState] = {}
        self._pending: dict[str, JobState] = {}
        self._running: dict[str, JobState] = {}
        ex = self.config.explain
        self.actions: RecentLog[Action] = RecentLog(ex.actions_kept)
        self.decisions = DecisionLog(per_job=ex.per_job, max_jobs=ex.max_jobs, enabled=ex.enabled)
        self.total_gpus = int(sum(n.n_gpus for n in nodes))
        self.plugins = build_plugins(self)

    # -- placement search, for plugins that place a job themselves (health's compact) -------
    def find_plan(self, job: JobState, ssn: Session) -> Plan | None:
        return actions_mod.find_plan(job, ssn)

    def permitted(self, plan: Plan, ssn: Session) -> str | None:
        """The first permit plugin's veto, or None."""
        return actions_mod.permitted(plan, ssn)

    # -- plugin access ---------------------------------------------------------------------
    def plugin(self, name: str):
        return self.plugins.by_name.get(name)

    # -- jobs -------------------------------------------------------------------------------
    def submit(self, spec: JobSpec, now: float | None = None) -> None:
        if spec.name in self.jobs:
            raise ValueError(f"job {spec.name!r} already submitted")
        if spec.n_gpus < 0 or (spec.n_gpus == 0 and spec.cpu_milli <= 0):
            raise ValueError(f"job {spec.name!r}: n_gpus must be >= 1 (or 0 for a CPU-only task with cpu_milli > 0)")
        if not 0 < spec.gpu_milli <= MILLI:
            raise ValueError(f"job {spec.name!r}: gpu_milli must be in 1..{MILLI}, got {spec.gpu_milli}")
        if spec.gpu_milli < MILLI and spec.n_gpus != 1:
            raise ValueError(f"job {spec.name!r}: a GPU share (gpu_milli < {MILLI}) is for one GPU, got n_gpus={spec.n_gpus}")
        if spec.gpus_per_node is not None and (spec.gpus_per_node < 1 or spec.n_gpus % spec.gpus_per_node):
            raise ValueError(f"job {spec.name!r}: n_gpus={spec.n_gpus} is not a multiple of gpus_per_node={spec.gpus_per_node}")
        js = JobState(spec, pending_since=spec.submit_ts)
        self.jobs[spec.name] = js
        self._pending[spec.name] = js
        for listener in self.plugins.submit_listeners:
            listener.on_submit(js)

    def cancel(self, job: str, now: float, reason: str = "cancelled") -> None:
        """Withdraw a job (pending or running); a running one releases its GPUs."""
        js = self.jobs[job]
        if js.state in ("completed", "failed", "cancelled"):
            return
        self._release(js)
        self._set_state(js, "cancelled")
        js.end_ts = now
        self.actions.append(Action(now, "cancelled", job=job, detail=reason))

    def checkpoint(self, job: str, step: int, now: float) -> None:
        js = self.jobs[job]
        js.last_checkpoint_step = step
        js.last_checkpoint_ts = now

    def _set_state(self, js: JobState, state: str) -> None:
        js.state = state
        name = js.spec.name
        self._pending.pop(name, None)
        self._running.pop(name, None)
        if state == "pending":
            self._pending[name] = js
        elif state == "running":
            self._running[name] = js

    def _release(self, js: JobState) -> None:
        name = js.spec.name
        per_node: dict[str, list[int]] = {}
        for node, gpu in js.placement:
            per_node.setdefault(node, []).append(gpu)
        n_slots = max(1, len(js.placement))
        for node, gpus in per_node.items():
            ns = self.nodes[node]
            used, shared = ns.used, ns.shared
            for gpu in gpus:
                # Plain dict operations, one change notice per node below.
                if used.get(gpu) == name:
                    dict.__delitem__(used, gpu)
                held = shared.get(gpu)
                if held and name in held:
                    del held[name]
                    if not held:
                        dict.__delitem__(shared, gpu)
            share = len(gpus) / n_slots
            ns.cpu_used -= int(round(js.spec.cpu_milli * share))
            ns.mem_used -= int(round(js.spec.memory_mib * share))
            ns.touch()
            if ns.state == "draining" and not ns.jobs():
                ns.state = "drained"
        js.placement = []
        self._clear_preemption(js)

    def _clear_preemption(self, js: JobState) -> None:
        js.preempt_deadline = None
        js.preempted_by = None
        js.preempt_notice_ts = None
        for victim in js.awaiting_victims:
            v = self.jobs.get(victim)
            if v is not None and v.preempted_by == js.spec.name:
                v.preempt_deadline, v.preempted_by, v.preempt_notice_ts = None, None, None
        js.awaiting_victims, js.awaiting_deadline, js.awaiting_nodes = [], None, []

    def work_since_checkpoint(self, js: JobState, now: float) -> float:
        """GPU-seconds of progress a restart of the running job now would throw away."""
        if js.state != "running" or js.start_ts is None:
            return 0.0
        since = js.start_ts if js.last_checkpoint_ts is None else max(js.start_ts, js.last_checkpoint_ts)
        return max(0.0, now - since) * js.gpu_demand

    def _requeue(self, js: JobState, now: float, why: str, hint_id: str | None = None, kind: str = "requeued") -> Action:
        if js.state == "running":
            js.lost_gpu_seconds += self.work_since_checkpoint(js, now) + self.config.health.restart_overhead_seconds * js.gpu_demand
        self._release(js)
        self._set_state(js, "pending")
        js.pending_since = now
        js.restarts += 1
        if kind == "preempted":
            js.preemptions += 1
            self._evicted += 1
        action = Action(
            now,
            kind,
            job=js.spec.name,
            detail=f"{why}; resumes from checkpoint step {js.last_checkpoint_step}"
            + (f", excluding {', '.join(sorted(js.excluded_nodes))}" if js.excluded_nodes else ""),
            hint_id=hint_id,
        )
        self.actions.append(action)
        return action

    def job_failed(self, job: str, now: float, reason: str) -> list[Action]:
        """A running job crashed (OOM, lost GPU): requeue it from its last checkpoint."""
        js = self.jobs[job]
        if js.state != "running":
            return []
        out = [Action(now, "failed", job=job, detail=reason)]
        self.actions.extend(out)
        out.append(self._requeue(js, now, f"crashed: {reason}"))
        return out

    def job_completed(self, job: str, now: float) -> None:
        js = self.jobs[job]
        if js.state in ("completed", "cancelled"):
            return
        self._release(js)
        self._set_state(js, "completed")
        js.end_ts = now
        self.actions.append(Action(now, "completed", job=job))

    # -- nodes ------------------------------------------------------------------------------
    def node_down(self, node: str, now: float, reason: str, requeue: bool = True) -> list[Action]:
        """The node is gone (hardware fault seen by the scheduler): jobs on it restart elsewhere."""
        ns = self.nodes[node]
        out: list[Action] = []
        if ns.state != "down":
            ns.state, ns.reason = "down", reason
            out.append(Action(now, "node_down", node=node, detail=reason))
            self.actions.append(out[-1])
        if requeue:
            for name in sorted(ns.jobs()):
                js = self.jobs[name]
                if js.state == "running":
                    out.append(self._requeue(js, now, f"node {node} down: {reason}"))
        return out

    def uncordon(self, node: str, now: float, reason: str = "repaired", trust_again: bool = True) -> list[Action]:
        """Return the node to service. After a repair (`trust_again`) jobs that were requeued
        away from it may use it again: the exclusion was about the fault, not the node."""
        ns = self.nodes[node]
        if trust_again:
            for js in self.jobs.values():
                js.excluded_nodes.discard(node)
        if ns.state == "up":
            return []
        ns.state, ns.reason = "up", ""
        a = Action(now, "uncordoned", node=node, detail=reason)
        self.actions.append(a)
        return [a]

    # -- placement --------------------------------------------------------------------------
    def sync_view(self) -> None:
        if self._dirty:
            idx = self.view.index
            changed = [idx[n] for n in self._dirty]
            self._dirty.clear()
            self.view.sync_many(changed)
            for listener in self.plugins.change_listeners:
                listener.on_change(changed)

    def commit(self, plan: Plan, now: float) -> Action:
        """Bind a plan for real (NodeState), after every permit plugin agreed."""
        js = plan.job
        name = js.spec.name
        v = self.view
        slots = [(v.names[n], g) for n, g in plan.slots]
        per_node: dict[str, list[int]] = {}
        for node, g in slots:
            per_node.setdefault(node, []).append(g)
        for node, gpus in per_node.items():
            ns = self.nodes[node]
            if plan.milli < MILLI:
                for g in gpus:
                    held = ns.shared.get(g)
                    if held is None:
                        dict.__setitem__(ns.shared, g, {name: plan.milli})
                    else:
                        held[name] = plan.milli
            elif gpus and gpus[0] >= 0:
                dict.update(ns.used, dict.fromkeys(gpus, name))
            share = len(gpus) / max(1, len(slots))
            ns.cpu_used += int(round(js.spec.cpu_milli * share))
            ns.mem_used += int(round(js.spec.memory_mib * share))
            ns.touch()
        js.placement = slots
        self._set_state(js, "running")
        js.start_ts = now
        if js.first_start_ts is None:
            js.first_start_ts = now
        if js.pending_since is not None:
            js.queued_seconds += max(0.0, now - js.pending_since)
        js.pending_since = None
        js.preferred_nodes = []
        self._clear_preemption(js)
        for listener in self.plugins.bind_listeners:
            listener.on_bind(js, plan)
        nodes = sorted(per_node)
        what = f"{js.spec.gpu_milli / MILLI:.2f} GPU" if plan.milli < MILLI else f"{js.spec.n_gpus} GPU(s)"
        a = Action(
            now,
            "placed",
            job=name,
            node=nodes[0] if len(nodes) == 1 else None,
            detail=f"{what} on {', '.join(nodes)}"
            + (f" (restart {js.restarts}, from step {js.last_checkpoint_step})" if js.restarts else ""),
        )
        self.actions.append(a)
        return a

    def cycle(self, now: float) -> list[Action]:
        """One scheduling cycle: open a session, run the configured actions, return what changed."""
        with self.actions.capture() as taken:
            self._cycle(now)
        return taken

    def _cycle(self, now: float) -> None:
        self.sync_view()
        pending = [js for js in self._pending.values() if js.state == "pending" and js.spec.submit_ts <= now]
        # Others may set a job running by hand (the simulator pins a scatter): follow them.
        for js in list(self._pending.values()):
            if js.state != "pending":
                self._set_state(js, js.state)
        for js in list(self._running.values()):
            if js.state != "running":
                self._set_state(js, js.state)
        evicted_before = self._evicted
        for _ in range(self.MAX_PASSES):
            ssn = Session(now=now, scheduler=self, view=self.view, pending=pending)
            for name in self.config.actions:
                actions_mod.ACTIONS[name](ssn)
                self.sync_view()
            # Jobs evicted in this pass are pending again: they are scheduled now (placed
            # elsewhere, or reclaiming their tenant's quota), not whenever the next cycle runs.
            if self._evicted == evicted_before:
                break
            evicted_before = self._evicted
            pending = [js for js in self._pending.values() if js.state == "pending" and js.spec.submit_ts <= now]

    # -- hints ------------------------------------------------------------------------------
    def apply_hint(self, hint: Hint, now: float) -> list[Action]:
        health = self.plugin("health")
        if health is None:
            return []
        return health.apply_hint(hint, now)

    def on_tick(self, result, window) -> None:  # pipeline Sink
        for hint in result.new_hints:
            self.apply_hint(hint, result.now)
        self.cycle(result.now)

    # -- explanations -----------------------------------------------------------------------
    def why(self, job: str) -> dict[str, Any] | None:
        """Why the job is where it is, or why it waits: its state, the decisions of the cycles
        that considered it (oldest first, repeats merged) and its latest actions. None for a job
        this scheduler does not know."""
        js = self.jobs.get(job)
        if js is None:
            return None
        history = self.decisions.history(job)
        recent: list[dict[str, Any]] = []
        want = self.config.explain.recent_actions
        for a in islice(reversed(self.actions), 50_000):  # the newest first, without a copy
            if len(recent) >= want:
                break
            if a.job == job:
                recent.append(a.to_json_dict())
        recent.reverse()
        latest = history[-1] if history else None
        if js.state == "running":
            nodes = sorted({n for n, _ in js.placement})
            summary = f"running on {', '.join(nodes[:8])}{' ...' if len(nodes) > 8 else ''}" + (f": {latest['reason']}" if latest and latest["outcome"] == "placed" else "")
        elif js.state == "pending":
            summary = f"pending: {latest['reason']}" if latest else "pending: not considered by a scheduling cycle yet"
        else:
            summary = js.state + (f": {recent[-1]['detail']}" if recent and recent[-1].get("detail") else "")
        return {
            "job": job,
            "state": js.state,
            "summary": summary,
            "tenant": js.spec.tenant,
            "priority": js.spec.priority,
            "n_gpus": js.spec.n_gpus,
            "gpu_milli": js.spec.gpu_milli,
            "gpus_per_node": js.spec.gpus_per_node,
            "placement": [list(p) for p in js.placement],
            "restarts": js.restarts,
            "preemptions": js.preemptions,
            "excluded_nodes": sorted(js.excluded_nodes),
            "decisions": history,
            "recent_actions": recent,
        }

    # -- state ------------------------------------------------------------------------------
    def placements(self) -> dict[str, list[tuple[str, int]]]:
        return {name: list(js.placement) for name, js in self.jobs.items() if js.state == "running"}

    def lost_gpu_seconds(self) -> float:
        return sum(js.lost_gpu_seconds for js in self.jobs.values())

    def state_frames(self) -> dict[str, pl.DataFrame]:
        jobs = schemas.frame(
            [
                {
                    "job": js.spec.name,
                    "tenant": js.spec.tenant,
                    "priority": js.spec.priority,
                    "n_gpus": js.spec.n_gpus,
                    "gpus_per_node": js.spec.gpus_per_node,
                    "state": js.state,
                    "submit_ts": js.spec.submit_ts,
                    "start_ts": js.start_ts,
                    "last_checkpoint_step": js.last_checkpoint_step,
                    "restarts": js.restarts,
                    "alloc_conf": js.alloc_conf,
                    "excluded_nodes": ",".join(sorted(js.excluded_nodes)),
                }
                for js in self.jobs.values()
            ],
            schemas.JOBS,
        )
        nodes = schemas.frame(
            [
                {
                    "node": ns.spec.name,
                    "rack": ns.spec.rack,
                    "n_gpus": ns.spec.n_gpus,
                    "gpu_memory_bytes": ns.spec.gpu_memory_bytes,
                    "state": ns.state,
                    "reason": ns.reason,
                    "free_gpus": len(ns.free_gpus()) if ns.schedulable else 0,
                }
                for ns in self.nodes.values()
            ],
            schemas.NODES,
        )
        allocs = schemas.frame(
            [
                {"job": name, "rank": r, "node": node, "gpu": gpu}
                for name, js in self.jobs.items()
                if js.state == "running"
                for r, (node, gpu) in enumerate(js.placement)
            ],
            schemas.ALLOCATIONS,
        )
        return {"jobs": jobs, "nodes": nodes, "allocations": allocs}


class SchedulerStateCollector:
    """Publishes the scheduler's job/node/allocation state as snapshot streams."""

    name = "scheduler"
    streams = {"jobs": schemas.JOBS, "nodes": schemas.NODES, "allocations": schemas.ALLOCATIONS}

    def __init__(self, scheduler: Scheduler, refresh_seconds: float = 30.0):
        self.scheduler = scheduler
        self.errors = 0
        self.refresh_seconds = refresh_seconds
        self._signature: tuple | None = None
        self._emitted_at = float("-inf")

    def _state_signature(self) -> tuple:
        # Placements, cordons and requeues all leave an action; checkpoints move a job's step.
        sched = self.scheduler
        return (sched.actions.total, len(sched.jobs), sum(js.last_checkpoint_step for js in sched.jobs.values()))

    def collect(self, now: float) -> dict[str, pl.DataFrame]:
        """Snapshots only when the state changed (or every `refresh_seconds`): rebuilding them
        for 100,000 GPUs on every tick would cost more than the detectors."""
        signature = self._state_signature()
        if signature == self._signature and now - self._emitted_at < self.refresh_seconds:
            return {}
        self._signature, self._emitted_at = signature, now
        return self.scheduler.state_frames()
