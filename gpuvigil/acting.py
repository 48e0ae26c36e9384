"""`serve --act off|dry-run|on`: what gpuvigil does to the real scheduler about its hints.

`Acting` is a pipeline sink placed after the HintStore. With `on` it applies the store's pending
hints through the Slurm or Kubernetes adapter (drain/resume/requeue; cordon/evict/taint) and
undoes what it did when a cause clears; with `dry-run` it says, once per hint (also across a
restart: the store keeps the note), what it would have run and changes nothing; with `off` it
does nothing. Every action and every dry-run is a log line, a count in
`gpuvigil_actions_total{scheduler,action,mode,outcome}`, and an entry in the hint store that the
feedback API serves (ack/nack/attempt for `on`; a `dry_run` note, shown as the
hint's state_reason, for `dry-run`). `make_acting` builds it for `serve` and for the
`gpuvigil act` leader alike.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Any

from gpuvigil.model import Hint, HintAction

log = logging.getLogger("gpuvigil.serve")
DRY_RUN_NOTE = "dry-run: would run: "  # a described hint's state_reason in the hint store


def describe_slurm(hint: Hint, adapter: Any) -> str:
    """The scontrol commands `SlurmAdapter.apply` would run for this hint."""
    act = hint.action
    if act in (HintAction.DRAIN_NODE, HintAction.CORDON_NODE):
        return f'scontrol update NodeName={hint.node} State=DRAIN Reason="{adapter.node_reason(hint)}"'
    if act == HintAction.REQUEUE_JOB:
        text = f"scontrol {'requeuehold' if hint.params.get('hold') else 'requeue'} {hint.job}"
        if hint.exclude_nodes:
            text += f"; scontrol update JobId={hint.job} ExcNodeList={','.join(sorted(hint.exclude_nodes))}"
        return text
    return f"nothing: Slurm cannot express {act.value} (the hint would be nacked)"


def describe_kubernetes(hint: Hint, cfg: Any) -> str:
    """The API calls `KubernetesAdapter.apply` would make for this hint."""
    from gpuvigil.scheduler.kubernetes import ANNOTATION_AVOID_GPUS, ANNOTATION_VERDICT, DOMAIN

    act, kind = hint.action, hint.finding_kind.value
    if act in (HintAction.CORDON_NODE, HintAction.DRAIN_NODE):
        effect = "NoSchedule" if act == HintAction.CORDON_NODE else cfg.taint_effect.get(kind, cfg.taint_effect.get("default", "NoSchedule"))
        text = f"cordon node {hint.node}, taint {DOMAIN}/{kind}={hint.finding_id}:{effect}, condition {cfg.condition_type}=False"
        if act == HintAction.DRAIN_NODE and hint.job:
            text += f", evict the pods of {hint.job} on {hint.node}"
        return text
    if act == HintAction.REQUEUE_JOB:
        nodes = hint.exclude_nodes or ([hint.node] if hint.node else [])
        return f"evict the pods of {hint.job} on {','.join(nodes) or 'no node'}; annotate {ANNOTATION_VERDICT} on {hint.job}"
    if act == HintAction.AVOID_GPU:
        return f"annotate node {hint.node} {ANNOTATION_AVOID_GPUS} += {hint.gpu}"
    return f"annotate {ANNOTATION_VERDICT} on {hint.job} ({act.value})"


def make_acting(scheduler: str, mode: str, *, store: Any, cfg: dict[str, Any]) -> Acting | None:
    """The `Acting` sink for `sources.scheduler` / `sources.act` (or `--scheduler` / `--act`), as
    `serve` and the `gpuvigil act` leader both build it: None without a scheduler. Kubernetes with
    `act: on` needs its API client now (a config error is a UserError); `dry-run` needs none."""
    if scheduler == "none":
        return None
    if scheduler == "slurm":
        from gpuvigil.scheduler.slurm import SlurmAdapter

        adapter = SlurmAdapter(store=store, cfg=cfg)
        return Acting("slurm", mode, store=store, adapter=adapter, describe=lambda h: describe_slurm(h, adapter))
    if scheduler != "kubernetes":
        raise ValueError(f"scheduler {scheduler!r}")
    from gpuvigil.errors import UserError
    from gpuvigil.scheduler.kubernetes import KubernetesAdapter, KubernetesError, kubernetes_config

    kcfg = kubernetes_config(cfg)
    k8s = None
    if mode == "on":
        try:
            k8s = KubernetesAdapter(store=store, cfg=cfg)
        except (KubernetesError, ImportError) as exc:
            raise UserError(f"source scheduler kubernetes: cannot act: {exc}") from exc
    return Acting("kubernetes", mode, store=store, adapter=k8s, describe=lambda h: describe_kubernetes(h, kcfg))


class Acting:
    """Applies (or describes) hints on a real scheduler; see the module docstring."""

    def __init__(self, scheduler: str, mode: str, *, store: Any, adapter: Any = None, describe: Any = None):
        if mode not in ("off", "dry-run", "on"):
            raise ValueError(f"act mode {mode!r}")
        if mode == "on" and adapter is None:
            raise ValueError("act on needs an adapter")
        self.scheduler = scheduler
        self.mode = mode
        self.store = store
        self.adapter = adapter
        self.describe = describe
        self.counts: Counter[tuple[str, str]] = Counter()  # (action, outcome)
        self._described: set[str] = set()

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
                self._act(result)
        except Exception as exc:  # acting must never stop the loop: loud, counted, retried next tick
            log.exception("act %s (%s): FAILED this tick: %s", self.mode, self.scheduler, exc)
            self._count("tick", "error")

    def _dry_run(self, result: Any) -> None:
        for hint in result.expired_hints:
            if hint.id in self._described and hint.action in (HintAction.DRAIN_NODE, HintAction.CORDON_NODE, HintAction.AVOID_GPU):
                log.info("act dry-run (%s): cause %s cleared: would undo %s on %s", self.scheduler, hint.finding_id, hint.action.value, hint.node)
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
            if hint.id in self._described:
                continue
            self._described.add(hint.id)
            what = self.describe(hint)
            log.info("act dry-run (%s): hint %s %s: would run: %s", self.scheduler, hint.action.value, hint.id, what)
            self._count(hint.action.value, "dry_run")
            if self.store is not None:
                try:
                    self.store.note(hint.id, "dry_run", f"{DRY_RUN_NOTE}{what}")
                except KeyError:
                    pass  # the hint expired between the read and the note

    def _act(self, result: Any) -> None:
        from gpuvigil.scheduler.apply import ApplyError, apply_hints, due_for_retry

        adapter = self.adapter
        for hint in result.expired_hints:
            adapter.retry.pop(hint.id, None)
            try:
                done = adapter.undo(hint)
            except ApplyError as exc:
                # Kept as it is (the safe side) until an operator looks: counted and logged.
                adapter.undo_errors += 1
                adapter.last_error = str(exc)
                log.error("act on (%s): undo %s for cleared cause %s FAILED: %s", self.scheduler, hint.action.value, hint.finding_id, exc)
                self._count(f"undo_{hint.action.value}", "failed")
                continue
            if done:
                log.warning("act on (%s): cause %s cleared: %s", self.scheduler, hint.finding_id, done)
                self._count(f"undo_{hint.action.value}", "done")
        if self.store is not None:
            now = time.time()
            cfg = adapter.config
            hints = [r.to_hint() for r in self.store.pending_hints() if due_for_retry(r, now, cfg.retry_base_seconds, cfg.retry_max_seconds)]
        else:
            hints = list(adapter.retry.values()) + list(result.new_hints)
        if not hints:
            return
        by_id = {h.id: h for h in hints}
        outcomes = apply_hints(adapter.outcome, hints, store=self.store, retry=adapter.retry)
        for hint_id, outcome in outcomes.items():
            hint = by_id[hint_id]
            status, _, detail = outcome.partition(": ")
            level = logging.WARNING if status == "acked" else logging.ERROR if status == "failed" else logging.INFO
            log.log(level, "act on (%s): hint %s %s %s: %s", self.scheduler, hint.action.value, hint_id, status, detail)
            self._count(hint.action.value, status)

    # -- metrics -------------------------------------------------------------------------------
    def families(self) -> list[Any]:
        from gpuvigil.exporter.metrics import Family

        fam = Family("gpuvigil_actions", "counter", "What serve did (or, with --act dry-run, would have done) to the scheduler, by hint action and outcome.")
        for (action, outcome), n in sorted(self.counts.items()):
            fam.add(n, scheduler=self.scheduler, action=action, mode=self.mode, outcome=outcome)
        mode = Family("gpuvigil_act_mode", "gauge", "1 for the acting mode serve runs with (off, dry-run, on).")
        mode.add(1, scheduler=self.scheduler, mode=self.mode)
        return [fam, mode]
