"""How scheduler adapters (Slurm, Kubernetes) plan, apply and report back on hints.

An adapter's `plan(hint)` returns a `Plan`: the steps it would take, each with the text a
dry-run prints. `apply(hint)` is `plan(hint).execute()`: the same steps, run. It either succeeds (the hint is acked with what was done), raises
`Unsupported` (the hint is nacked with the reason: that scheduler cannot express it), or raises
`ApplyError` (a command or API call failed: the hint stays pending with the error recorded, and
is tried again). Nothing is lost on failure.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from gpuvigil.util.backoff import backoff_seconds
from gpuvigil.errors import UserError
from gpuvigil.model import Hint


class ApplyError(UserError):
    """Applying a hint failed; the message says which command/call and why."""


class Unsupported(ApplyError):
    """The scheduler cannot express this hint; it is nacked with this reason."""


def due_for_retry(record: Any, now: float, base_seconds: float, max_seconds: float) -> bool:
    """A stored pending hint whose last apply failed waits base·2^(attempts-1) seconds (capped,
    with jitter: `gpuvigil.util.backoff`) before the next try, so a hint Slurm/Kubernetes keeps
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


class Step:
    """One thing an adapter does for a hint: `text` is what a dry-run prints and the log says,
    `run` does it and returns what was done ("" when there was nothing to do)."""

    __slots__ = ("run", "text")

    def __init__(self, text: str, run: Callable[[], str]):
        self.text = text
        self.run = run


class Plan:
    """What an adapter would do for one hint, as it will do it: `describe()` is the dry-run
    text and `execute()` runs the very same steps. `outcome` says, after `execute()`, whether
    the node turned out to be someone else's ("not_ours": an operator's drain or cordon, left as
    it is) or not to need it ("absent": an undo found nothing of ours to take back)."""

    def __init__(self, hint: Hint, steps: list[Step]):
        self.hint = hint
        self.steps = steps
        self.outcome = "done"

    def describe(self) -> str:
        return ", ".join(s.text for s in self.steps) or "nothing"

    def execute(self) -> str:
        done = [d for d in (s.run() for s in self.steps) if d]
        return ", ".join(done)
