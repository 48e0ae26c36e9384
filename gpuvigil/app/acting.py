"""`serve --act off|dry-run|on`: what gpuvigil does to the real scheduler about its hints.

`Acting` is the one apply loop: a pipeline sink placed after the HintStore, run by `serve`, by the
`gpuvigil act` leader (both build it with `make_acting`) and by the tests against a real
slurmctld. Each tick:

1. Causes: a hint that expired marks its finding quiet on the node's quarantine record
   (`gpuvigil.scheduler.quarantine`); a finding reported again makes it active again.
2. Hints: each pending hint (from the store, due for a retry, whose finding is active now: a
   hint left from before a restart whose cause is gone is never acted on) goes through the
   adapter's `plan(hint)`. With `dry-run`, the plan's own text is logged once per hint (also
   across a restart: the store keeps the note) and nothing changes. With `on`, a hint that takes
   a node or GPU out of service first asks the circuit breaker; admitted, the same plan runs and
   the record moves suspect → cordoned/draining. While the breaker is open every hint is dry-run
   (said once per hint), and on-call is paged once through the alert path.
3. Return to service: a record gpuvigil holds out moves to remediating once every cause is quiet,
   and to verifying, then healthy, through its `Steps` (default `HoldDown`: every cause quiet for
   `acting.hold_down_seconds`, never the first quiet tick). Only then does the adapter's undo
   plan run, and only on what is still gpuvigil's: an operator's drain, or a node gpuvigil did
   not take out, becomes `operator_held` and is never undone.

Every action and dry-run is a log line, a count in
`gpuvigil_actions_total{scheduler,action,mode,outcome}`, and an entry in the hint store the
feedback API serves (ack/nack/attempt; a `dry_run` note shown as the hint's state_reason). After
a restart the loop resumes from the stored records: a node already drained is not drained again.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from gpuvigil.model import Hint, HintAction
from gpuvigil.scheduler.quarantine import (
    OURS,
    ActingConfig,
    Breaker,
    HoldDown,
    QuarantineMachine,
    QuarantineStore,
    Record,
    State,
    Steps,
    Transition,
    acting_config,
    store_beside,
)

log = logging.getLogger("gpuvigil.app.serve")
DRY_RUN_NOTE = "dry-run: would run: "  # a described hint's state_reason in the hint store
BREAKER_NOTE = "breaker open: would run: "
NODE_ACTIONS = (HintAction.DRAIN_NODE, HintAction.CORDON_NODE)
OUT_ACTIONS = (*NODE_ACTIONS, HintAction.AVOID_GPU)  # hints that take capacity out of service


def make_acting(
    scheduler: str, mode: str, *, store: Any, cfg: dict[str, Any], pager: Callable[[str, bool], None] | None = None, steps: Steps | None = None
) -> Acting | None:
    """The `Acting` sink for `sources.scheduler` / `sources.act` (or `--scheduler` / `--act`), as
    `serve` and the `gpuvigil act` leader both build it: None without a scheduler. Kubernetes with
    `act: on` needs its API client now (a config error is a UserError); `dry-run` needs none.
    The quarantine state and the breaker live beside the hint store (in memory without one);
    `steps` are the remediation and return-to-service check (default: the remediation ladder
    when `remediation.enabled`, else the hold-down alone)."""
    if scheduler == "none":
        return None
    if scheduler == "slurm":
        from gpuvigil.scheduler.slurm import SlurmAdapter

        adapter: Any = SlurmAdapter(store=store, cfg=cfg)
    elif scheduler == "kubernetes":
        from gpuvigil.errors import UserError
        from gpuvigil.scheduler.kubernetes import KubernetesAdapter, KubernetesError

        try:
            adapter = KubernetesAdapter(store=store, cfg=cfg, connect=mode == "on")
        except (KubernetesError, ImportError) as exc:
            raise UserError(f"source scheduler kubernetes: cannot act: {exc}") from exc
    else:
        raise ValueError(f"scheduler {scheduler!r}")
    qstore = store_beside(getattr(store, "path", None)) if mode == "on" else None
    if steps is None and qstore is not None:
        from gpuvigil.scheduler.remediation import make_steps

        steps = make_steps(cfg, QuarantineMachine(qstore), store=store, adapter=adapter)  # None: the hold-down
    return Acting(scheduler, mode, store=store, adapter=adapter, cfg=acting_config(cfg), quarantine=qstore, pager=pager, steps=steps)


class Acting:
    """Applies (or describes) hints on a real scheduler; see the module docstring."""

    def __init__(
        self,
        scheduler: str,
        mode: str,
        *,
        store: Any,
        adapter: Any = None,
        cfg: ActingConfig | None = None,
        quarantine: QuarantineStore | None = None,
        steps: Steps | None = None,
        pager: Callable[[str, bool], None] | None = None,
    ):
        if mode not in ("off", "dry-run", "on"):
            raise ValueError(f"act mode {mode!r}")
        if mode != "off" and adapter is None:
            raise ValueError(f"act {mode} needs an adapter")
        self.scheduler = scheduler
        self.mode = mode
        self.store = store
        self.adapter = adapter
        self.cfg = cfg or ActingConfig()
        self.quarantine = quarantine or QuarantineStore(":memory:")
        self.machine = QuarantineMachine(self.quarantine)
        self.breaker = Breaker(self.quarantine, self.cfg.breaker, scope=scheduler)
        self.steps: Steps = steps or HoldDown(self.cfg.hold_down_seconds)
        self.pager = pager
        self.counts: Counter[tuple[str, str]] = Counter()  # (action, outcome)
        self._described: set[str] = set()
        self.retry: dict[str, Hint] = {}  # without a store: hints that failed, retried next tick
        self.undo_errors = 0
        self.last_error: str | None = None
        self._inventory: dict[str, int] = {}
        self._inventory_at = float("-inf")
        self._was_open = self.breaker.is_open

    def _count(self, action: str, outcome: str) -> None:
        self.counts[(action, outcome)] += 1

    # -- sink ----------------------------------------------------------------------------------
    def on_tick(self, result: Any, window: Any = None) -> None:
        if self.mode == "off":
            return
        try:
            if self.mode == "dry-run":
                self._dry_run(result)
            else:
                self._act(result, window)
        except Exception as exc:  # acting must never stop the loop: loud, counted, retried next tick
            log.exception("act %s (%s): FAILED this tick: %s", self.mode, self.scheduler, exc)
            self._count("tick", "error")

    def _plan_text(self, hint: Hint) -> str:
        from gpuvigil.scheduler.apply import ApplyError, Unsupported

        try:
            return self.adapter.plan(hint).describe()
        except Unsupported as exc:
            return f"nothing: {exc} (the hint would be nacked)"
        except ApplyError as exc:
            return f"nothing: {exc} (the apply would fail, and be retried)"

    def _describe(self, hint: Hint, note: str, outcome: str) -> None:
        """Say once what the adapter's plan for this hint is, without running it."""
        if hint.id in self._described:
            return
        self._described.add(hint.id)
        what = self._plan_text(hint)
        tag = "dry-run" if outcome == "dry_run" else "on, breaker open"
        log.info("act %s (%s): hint %s %s: would run: %s", tag, self.scheduler, hint.action.value, hint.id, what)
        self._count(hint.action.value, outcome)
        if self.store is not None:
            try:
                self.store.note(hint.id, "dry_run", f"{note}{what}")
            except KeyError:
                pass  # the hint expired between the read and the note

    def _dry_run(self, result: Any) -> None:
        for hint in result.expired_hints:
            if hint.id in self._described and hint.action in OUT_ACTIONS:
                log.info(
                    "act dry-run (%s): cause %s cleared: would undo %s on %s once quiet for %.0f s",
                    self.scheduler, hint.finding_id, hint.action.value, hint.node, self.cfg.hold_down_seconds,
                )
                self._count(f"undo_{hint.action.value}", "dry_run")
            self._described.discard(hint.id)
        if self.store is None:
            pending = list(result.new_hints)
        else:
            pending = []
            for rec in self.store.pending_hints():
                hint = rec.to_hint()
                if (rec.state_reason or "").startswith(DRY_RUN_NOTE):
                    # Described before this Acting existed (serve restarted, or the act leader
                    # lost and retook its lease): said once already, durably, in the store.
                    self._described.add(hint.id)
                    continue
                pending.append(hint)
        for hint in pending:
            self._describe(hint, DRY_RUN_NOTE, "dry_run")

    # -- acting --------------------------------------------------------------------------------
    def _pending(self, result: Any) -> list[Hint]:
        from gpuvigil.scheduler.apply import due_for_retry

        active = {f.id for f in result.active_findings}
        if self.store is not None:
            now = time.time()
            cfg = self.adapter.config
            hints = [r.to_hint() for r in self.store.pending_hints() if due_for_retry(r, now, cfg.retry_base_seconds, cfg.retry_max_seconds)]
        else:
            hints = list(self.retry.values()) + [h for h in result.new_hints if h.id not in self.retry]
        # Only a live cause is acted on: a hint stored before a restart, or held back while the
        # breaker was open, whose finding is no longer reported waits (and expires with it).
        return [h for h in hints if h.finding_id in active]

    def _fleet(self, window: Any) -> dict[str, int]:
        nodes = window.get("nodes") if window is not None else None
        if nodes is not None and nodes.height and {"node", "n_gpus"} <= set(nodes.columns):
            return {str(n): int(g or 0) for n, g in nodes.select("node", "n_gpus").unique("node").iter_rows()}
        now = time.monotonic()
        if now - self._inventory_at > 300:
            try:
                self._inventory = dict(self.adapter.inventory())
            except Exception as exc:  # noqa: BLE001 - a fleet we cannot count is one node: the breaker's floor
                log.warning("act on (%s): cannot count the fleet for the breaker: %s", self.scheduler, exc)
            self._inventory_at = now
        return self._inventory

    def _act(self, result: Any, window: Any) -> None:
        now = result.now
        # A cause is quiet once its finding cleared (a finding that came back within the hint
        # cooldown has no hint of its own to expire).
        quiet = {f.id for f in result.cleared_findings} | {h.finding_id for h in result.expired_hints}
        for hint in result.expired_hints:
            self.retry.pop(hint.id, None)
        self.machine.observe({f.id for f in result.active_findings}, quiet, now)
        hints = self._pending(result)
        if self.breaker.is_open:
            for hint in hints:
                if hint.action in OUT_ACTIONS and hint.node:
                    self._refuse(hint, now, window)
                self._describe(hint, BREAKER_NOTE, "breaker_open")
        else:
            self._described.clear()  # a later opening says each held-back hint again
            for hint in hints:
                if self.breaker.is_open:  # tripped by an earlier hint of this tick
                    if hint.action in OUT_ACTIONS and hint.node:
                        self._refuse(hint, now, window)
                    self._describe(hint, BREAKER_NOTE, "breaker_open")
                elif hint.action in OUT_ACTIONS and hint.node:
                    self._take_out(hint, now, window)
                else:
                    self._apply(hint)
        page = self.breaker.page_due()
        if page is not None:
            log.error("act on (%s): %s", self.scheduler, page)
            self._count("breaker", "opened")
            self._page(page, True)
        is_open = self.breaker.is_open
        if self._was_open and not is_open:
            # Closed by a person (`gpuvigil breaker close` or the API, maybe another process).
            log.warning("act on (%s): breaker closed: acting resumes on live causes only", self.scheduler)
            self._page("breaker closed: acting resumes", False)
        self._was_open = is_open
        if not self.breaker.is_open:  # while open, gpuvigil changes nothing on the scheduler
            for rec in self.machine.records(OURS):
                self._advance(rec, now)

    def _page(self, text: str, firing: bool) -> None:
        if self.pager is None:
            return
        try:
            self.pager(text, firing)
        except Exception as exc:  # noqa: BLE001 - the log line is the page of last resort
            log.error("act on (%s): the breaker page could not be queued: %s", self.scheduler, exc)

    def _apply(self, hint: Hint) -> str:
        from gpuvigil.scheduler.apply import apply_hints

        outcome = apply_hints(self.adapter.outcome, [hint], store=self.store, retry=self.retry if self.store is None else None)[hint.id]
        if self.store is None and not outcome.startswith("failed"):
            self.retry.pop(hint.id, None)
        status, _, detail = outcome.partition(": ")
        level = logging.WARNING if status == "acked" else logging.ERROR if status == "failed" else logging.INFO
        log.log(level, "act on (%s): hint %s %s %s: %s", self.scheduler, hint.action.value, hint.id, status, detail)
        self._count(hint.action.value, status)
        return outcome

    def _size(self, hint: Hint, fleet: dict[str, int]) -> tuple[int, int]:
        if hint.action == HintAction.AVOID_GPU:
            return 0, 1
        return 1, fleet.get(hint.node or "") or max(fleet.values(), default=1) or 1

    def _admit(self, hint: Hint, rec: Any, fleet: dict[str, int], now: float, cause: str) -> bool:
        """Ask the breaker. The drains of one named component (a leaf switch, a rack) are one
        action: its first hint is admitted as one node, and its other nodes' hints follow it
        (the breaker's window already holds that key), so a switch is not 40 node removals."""
        nodes, gpus = self._size(hint, fleet)
        component = hint.params.get("component_action")
        key = f"component:{component}" if component else rec.key
        return self.breaker.admit(key, nodes=nodes, gpus=gpus, fleet_nodes=len(fleet), fleet_gpus=sum(fleet.values()), now=now, cause=cause)

    def _refuse(self, hint: Hint, now: float, window: Any) -> None:
        fleet = self._fleet(window)
        rec = self.machine.get(hint.node or "", hint.gpu if hint.action == HintAction.AVOID_GPU else None)
        if rec.out_of_service:
            return
        self._admit(hint, rec, fleet, now, hint.finding_kind.value)
        if rec.state == State.HEALTHY:
            self.machine.add_cause(rec, finding_id=hint.finding_id, kind=hint.finding_kind.value, summary=hint.reason, hint_id=hint.id)
            self._move(rec, State.SUSPECT, now, rule="finding", cause=f"{hint.finding_kind.value}: {hint.reason}", ids=[hint.finding_id], detail="breaker open: not applied")

    def _take_out(self, hint: Hint, now: float, window: Any) -> None:
        from gpuvigil.scheduler.apply import ApplyError, Unsupported

        gpu = hint.gpu if hint.action == HintAction.AVOID_GPU else None
        rec = self.machine.get(hint.node or "", gpu)
        kind = hint.finding_kind.value
        if rec.state in (State.RMA, State.OPERATOR_HELD):
            self._nack(hint, f"{rec.key} is {rec.state.value}: gpuvigil leaves it to the operator")
            return
        try:
            plan = self.adapter.plan(hint)
        except Unsupported as exc:
            self._nack(hint, str(exc))
            return
        except ApplyError as exc:
            self._failed(hint, str(exc))
            return
        self.machine.add_cause(rec, finding_id=hint.finding_id, kind=kind, summary=hint.reason, hint_id=hint.id)
        if rec.ours and not (rec.state == State.CORDONED and hint.action == HintAction.DRAIN_NODE):
            # Out already, for this cause or another: the new cause only joins the record.
            self.machine.save(rec)
            self._ack(hint, f"{rec.key} already {rec.state.value} by gpuvigil ({rec.applied or rec.action}): cause added")
            return
        if rec.state == State.HEALTHY:
            self._move(rec, State.SUSPECT, now, rule="finding", cause=f"{kind}: {hint.reason}", ids=[hint.finding_id])
        if not rec.ours:
            if not self._admit(hint, rec, self._fleet(window), now, kind):
                self._describe(hint, BREAKER_NOTE, "breaker_open")
                return
        if rec.state == State.SUSPECT and rec.action == hint.action.value and (rec.hint or {}).get("id") == hint.id:
            # The intent was written and the process stopped before the outcome was: what the
            # scheduler shows decides, and a command that ran is not run again.
            seen = self._already_applied(hint)
            if seen:
                rec.applied = seen
                to = State.CORDONED if hint.action != HintAction.DRAIN_NODE else State.DRAINING
                self._move(rec, to, now, rule="found_applied", cause=f"{kind}: {hint.reason}", ids=[hint.finding_id], detail=f"found after a restart: {seen}")
                self._ack(hint, seen)
                return
        # Intent first: a restart between the command and its record finds the action named.
        rec.action, rec.hint, rec.scheduler = hint.action.value, hint.to_json_dict(), self.scheduler
        self.machine.save(rec)
        try:
            detail = plan.execute()
        except Unsupported as exc:
            self._nack(hint, str(exc))
            return
        except ApplyError as exc:
            self._failed(hint, str(exc))
            return
        if plan.outcome == "not_ours":
            self._move(rec, State.OPERATOR_HELD, now, rule="operator_owns_node", cause=detail, ids=[hint.finding_id])
            self._ack(hint, detail)
            return
        rec.applied = detail
        to = State.CORDONED if hint.action != HintAction.DRAIN_NODE else State.DRAINING
        self._move(rec, to, now, rule="applied", cause=f"{kind}: {hint.reason}", ids=[hint.finding_id], detail=detail)
        self._ack(hint, detail)

    def _already_applied(self, hint: Hint) -> str | None:
        from gpuvigil.scheduler.apply import ApplyError

        probe = getattr(self.adapter, "applied_by_us", None)
        if probe is None:
            return None
        try:
            return probe(hint)
        except ApplyError as exc:
            log.warning("act on (%s): cannot read whether %s was applied: %s", self.scheduler, hint.id, exc)
            return None

    def _advance(self, rec: Record, now: float) -> None:
        moved = self.machine.advance(rec, self.steps, now)
        if moved is not None:
            self._audit(rec, moved)
        if not self.machine.verified(rec):
            return
        from gpuvigil.scheduler.apply import ApplyError

        hint = Hint(**{k: v for k, v in (rec.hint or {}).items() if k != "id"}) if rec.hint else None
        plan = self.adapter.undo_plan(hint) if hint is not None else None
        action = f"undo_{rec.action}"
        try:
            done = plan.execute() if plan is not None else ""
        except ApplyError as exc:
            # Kept out (the safe side) and tried again next tick: counted and logged.
            self.undo_errors += 1
            self.last_error = str(exc)
            log.error("act on (%s): return %s to service FAILED: %s", self.scheduler, rec.key, exc)
            self._count(action, "failed")
            return
        ids = list(rec.causes)
        if plan is not None and plan.outcome == "not_ours":
            self._move(rec, State.OPERATOR_HELD, now, rule="operator_owns_node", cause="the node is no longer as gpuvigil left it: an operator holds it", ids=ids, detail=done)
            self._count(action, "operator_held")
            return
        self._move(rec, State.HEALTHY, now, rule="returned", cause=f"every cause quiet, check passed: {rec.steps.get('verify', {}).get('detail', '')}", ids=ids, detail=done or "nothing left to undo")
        log.warning("act on (%s): %s returned to service: %s", self.scheduler, rec.key, done or "nothing left to undo")
        self._count(action, "done")

    # -- bookkeeping ---------------------------------------------------------------------------
    def _move(self, rec: Record, to: State, now: float, *, rule: str, cause: str, ids: list[str], detail: str = "") -> None:
        t = self.machine.transition(rec, to, now=now, rule=rule, cause=cause, finding_ids=ids, detail=detail)
        log.info("act on (%s): %s %s", self.scheduler, rec.key, t.line())
        self._audit(rec, t)

    def _audit(self, rec: Record, t: Transition) -> None:
        """Where operators look: Kubernetes node annotation and event (Slurm's is the drain
        Reason, set with the drain)."""
        record = getattr(self.adapter, "record_quarantine", None)
        if record is None or rec.gpu is not None:
            return
        summary = {"state": t.to_state, "since": t.ts, "rule": t.rule, "who": t.who, "finding_ids": t.finding_ids, "causes": sorted({c.kind for c in rec.causes.values()})}
        try:
            record(rec.node, summary, t.line())
        except Exception as exc:  # noqa: BLE001 - the audit copy on the node is best effort; the store has it
            log.warning("act on (%s): cannot record the quarantine state on node %s: %s", self.scheduler, rec.node, exc)

    def _ack(self, hint: Hint, detail: str) -> None:
        if self.store is not None:
            self.store.record_attempt(hint.id, None)
            self.store.ack(hint.id, detail)
        self.retry.pop(hint.id, None)
        log.warning("act on (%s): hint %s %s acked: %s", self.scheduler, hint.action.value, hint.id, detail)
        self._count(hint.action.value, "acked")

    def _nack(self, hint: Hint, reason: str) -> None:
        if self.store is not None:
            self.store.nack(hint.id, reason)
        self.retry.pop(hint.id, None)
        log.info("act on (%s): hint %s %s nacked: %s", self.scheduler, hint.action.value, hint.id, reason)
        self._count(hint.action.value, "nacked")

    def _failed(self, hint: Hint, error: str) -> None:
        if self.store is not None:
            self.store.record_attempt(hint.id, error)
        else:
            self.retry[hint.id] = hint
        log.error("act on (%s): hint %s %s failed: %s", self.scheduler, hint.action.value, hint.id, error)
        self._count(hint.action.value, "failed")

    # -- metrics -------------------------------------------------------------------------------
    def families(self) -> list[Any]:
        from gpuvigil.exporter.metrics import Family

        fam = Family("gpuvigil_actions", "counter", "What serve did (or, with --act dry-run, would have done) to the scheduler, by hint action and outcome.")
        for (action, outcome), n in sorted(self.counts.items()):
            fam.add(n, scheduler=self.scheduler, action=action, mode=self.mode, outcome=outcome)
        mode = Family("gpuvigil_act_mode", "gauge", "1 for the acting mode serve runs with (off, dry-run, on).")
        mode.add(1, scheduler=self.scheduler, mode=self.mode)
        out = [fam, mode]
        if self.mode == "on":
            states = Counter(r.state.value for r in self.machine.records())
            q = Family("gpuvigil_quarantine_records", "gauge", "Nodes and GPUs in each quarantine state (healthy ones gpuvigil acted on before included).")
            for s in State:
                q.add(states.get(s.value, 0), scheduler=self.scheduler, state=s.value)
            out += [q, *self.breaker.families()]
        return out
