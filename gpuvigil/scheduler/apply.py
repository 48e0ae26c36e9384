"""How scheduler adapters (Slurm, Kubernetes) report back on the hints they apply.

An adapter's `apply(hint)` either succeeds (the hint is acked with what was done), raises
`Unsupported` (the hint is nacked with the reason: that scheduler cannot express it), or raises
`ApplyError` (a command or API call failed: the hint stays pending with the error recorded, and
is tried again). Nothing is lost on failure.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from gpuvigil.backoff import backoff_seconds
from gpuvigil.errors import UserError
from gpuvigil.model import Hint


class ApplyError(UserError):
    """Applying a hint failed; the message says which command/call and why."""


class Unsupported(ApplyError):
    """The scheduler cannot express this hint; it is nacked with this reason."""


def due_for_retry(record: Any, now: float, base_seconds: float, max_seconds: float) -> bool:
    """A stored pending hint whose last apply failed waits base·2^(attempts-1) seconds (capped,
    with jitter: `gpuvigil.backoff`) before the next try, so a hint Slurm/Kubernetes keeps
    refusing does not hammer it each tick, and hints that failed together do not retry together.
    The jitter is fixed per (hint, attempt): asking again gives the same answer."""
    if not record.last_error or record.attempts < 1:
        return True
    wait = backoff_seconds(record.attempts, base_seconds, max_seconds, key=f"{getattr(record, 'id', '')}:{record.attempts}")
    return now - record.updated_wall >= wait  # both wall clock (HintRecord.updated_wall)


def apply_hints(apply: Callable[[Hint], str], hints: Iterable[Hint], *, store: Any = None, retry: dict[str, Hint] | None = None) -> dict[str, str]:
    """Apply each hint; ack/nack/record the outcome in `store` (a HintStore) if given, else keep
    failures in `retry`. Returns hint id → "acked: ...", "nacked: ..." or "failed: ..."; never raises
    an ApplyError."""
    outcome: dict[str, str] = {}
    for hint in hints:
        try:
            detail = apply(hint)
        except Unsupported as exc:
            outcome[hint.id] = f"nacked: {exc}"
            if store is not None:
                store.nack(hint.id, str(exc))
            if retry is not None:
                retry.pop(hint.id, None)
        except ApplyError as exc:
            outcome[hint.id] = f"failed: {exc}"
            if store is not None:
                store.record_attempt(hint.id, str(exc))
            elif retry is not None:
                retry[hint.id] = hint
        else:
            outcome[hint.id] = f"acked: {detail}"
            if store is not None:
                store.record_attempt(hint.id, None)
                store.ack(hint.id, detail)
            if retry is not None:
                retry.pop(hint.id, None)
    return outcome


class HintApplier:
    """What the Slurm and Kubernetes adapters share: applying the store's pending hints (those
    due for a retry) and, as a pipeline sink, undoing what they did when a hint expires.

    A subclass provides `outcome(hint) -> str` (apply it, return what was done), `undo(hint)`,
    and the attributes `store`, `retry`, `config` (retry_base_seconds, retry_max_seconds),
    `undo_errors` and `last_error`.
    """

    store: Any
    retry: dict[str, Hint]
    config: Any
    undo_errors: int
    last_error: str | None

    def outcome(self, hint: Hint) -> str:
        raise NotImplementedError

    def undo(self, hint: Hint) -> str | None:
        raise NotImplementedError

    def apply_pending(self, hints: Iterable[Hint] | None = None) -> dict[str, str]:
        """Apply hints (default: every pending hint in the store that is due). Returns hint id →
        `acked: ...`, `nacked: ...` or `failed: ...`; failures never raise here."""
        if hints is None:
            if self.store is None:
                raise ValueError("apply_pending() without hints needs a store")
            now = time.time()
            hints = [
                r.to_hint()
                for r in self.store.pending_hints()
                if due_for_retry(r, now, self.config.retry_base_seconds, self.config.retry_max_seconds)
            ]
        return apply_hints(self.outcome, hints, store=self.store, retry=self.retry)

    def on_tick(self, result: Any, window: Any = None) -> None:
        """Pipeline sink. Put it after the HintStore in the sink list so the store has the hints."""
        for hint in result.expired_hints:
            self.retry.pop(hint.id, None)
            try:
                self.undo(hint)
            except ApplyError as exc:
                # Counted, not raised into the loop: the node keeps its drain/taint (the safe
                # side) until an operator looks.
                self.undo_errors += 1
                self.last_error = str(exc)
        if self.store is not None:
            self.apply_pending()
        else:
            self.apply_pending(list(self.retry.values()) + list(result.new_hints))
