"""An append-only record that keeps its newest entries and counts all of them.

Why: `serve` runs for weeks. The pipeline's record of every finding and hint raised, and the
scheduler's record of every action taken, used to be plain lists kept for the life of the process:
slow, steady growth that a soak shows (docs/reliability.md). Their readers follow them
with a cursor (the exporter folds in what is new each scrape; a cycle returns the actions it
appended), so the cursor is the running count, `total`, not a position in what is kept.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from itertools import islice
from typing import Generic, TypeVar

T = TypeVar("T")


class RecentLog(Generic[T]):
    """Keeps the newest `keep` entries (all of them when `keep` is None).

    `total` counts every entry ever appended. `since(cursor)` returns the entries appended after a
    reader's last `total`; entries dropped meanwhile are gone, and `dropped` says how many were
    dropped in all. Iterating and indexing see the kept entries, oldest first."""

    def __init__(self, keep: int | None = None, items: Iterable[T] = ()):
        if keep is not None and keep < 1:
            raise ValueError(f"keep must be >= 1 or None, got {keep}")
        self.keep = keep
        self._items: deque[T] = deque(maxlen=keep)
        self.total = 0
        self._captures: list[list[T]] = []
        self.extend(items)

    def append(self, item: T) -> None:
        self._items.append(item)
        self.total += 1
        for taken in self._captures:
            taken.append(item)

    @contextmanager
    def capture(self) -> Iterator[list[T]]:
        """Every entry appended inside the block, however few are kept (a scheduling cycle
        returns all the actions it took)."""
        taken: list[T] = []
        self._captures.append(taken)
        try:
            yield taken
        finally:
            self._captures.remove(taken)

    def extend(self, items: Iterable[T]) -> None:
        for item in items:
            self.append(item)

    @property
    def dropped(self) -> int:
        return self.total - len(self._items)

    def since(self, cursor: int) -> list[T]:
        """Entries appended after `cursor` (a `total` read earlier) that are still kept."""
        new = min(self.total - cursor, len(self._items))
        if new <= 0:
            return []
        return list(islice(reversed(self._items), new))[::-1]  # from the new end: O(new), not O(kept)

    def every(self) -> list[T]:
        """Every entry ever appended; a LookupError if some were dropped (a reader that must see
        them all, such as a benchmark scoring a run, says so instead of scoring a part)."""
        if self.dropped:
            raise LookupError(f"{self.dropped} of {self.total} entries were dropped (keep={self.keep}): raise the limit")
        return list(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[T]:
        return iter(self._items)

    def __reversed__(self) -> Iterator[T]:
        return reversed(self._items)

    def __getitem__(self, index: int) -> T:
        return self._items[index]

    def __repr__(self) -> str:
        return f"RecentLog(keep={self.keep}, total={self.total}, kept={len(self._items)})"
