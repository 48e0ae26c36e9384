"""How scheduler adapters (Slurm, Kubernetes) report back on the hints they apply.

An adapter's `apply(hint)` either succeeds (the hint is acked with what was done), raises
`Unsupported` (the hint is nacked with the reason: that scheduler cannot express it), or raises
`ApplyError` (a command or API call failed: the hint stays pending with the error recorded, and
is tried again). Nothing is lost on failure.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from gpuvigil.errors import UserError
from gpuvigil.model import Hint


class ApplyError(UserError):
    """Applying a hint failed; the message says which command/call and why."""


class Unsupported(ApplyError):
    """The scheduler cannot express this hint; it is nacked with this reason."""


def due_for_retry(record: Any, now: float, base_seconds: float, max_seconds: float) -> bool:
    """A stored pending hint whose last apply failed waits base·2^(attempts-1) seconds (capped)
    before the next try, so a hint Slurm/Kubernetes keeps refusing does not hammer it each tick."""
    if not record.last_error or record.attempts < 1:
        return True
    wait = min(base_seconds * 2 ** (record.attempts - 1), max_seconds)
    return now - record.updated_ts >= wait


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
