"""Fencing of what detect replicas publish under a partition lease.

A detect replica stamps its findings messages with its id and the lease's epoch (the revision at
which it took `part.<p>`, `Leases.epoch`): epochs only grow from one holder to the next. As soon as
it takes a partition, before its replay has caught up, it publishes a claim (`"claim": true`, no
findings) on the partition's subject and repeats it while it catches up. A reader (act) keeps, per
subject, the newest epoch it has seen, and drops a message with an older one: a replica that was
paused (SIGSTOP, a long GC, a VM migration) past its lease and publishes on waking is ignored once
the new owner has claimed the partition, even before the new owner has anything to say.

A claim carries no findings: the reader keeps the previous owner's findings meanwhile (refreshed,
so they neither age out nor clear during the takeover), and the new owner's first real message
replaces them. Messages without an epoch (an agent's node findings: no lease) are always admitted.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

log = logging.getLogger("gpuvigil.fleet")


class Fence:
    def __init__(self) -> None:
        self.newest: dict[str, tuple[int, str]] = {}  # subject → (epoch, owner) of the newest holder seen
        self.dropped: Counter[str] = Counter()  # owner → stale messages dropped

    def admit(self, subject: str, doc: dict[str, Any]) -> bool:
        """True when `doc` (a findings message on `subject`) comes from the newest holder seen."""
        epoch, owner = doc.get("epoch"), doc.get("owner")
        if not isinstance(epoch, int) or isinstance(epoch, bool):
            return True
        owner = str(owner)
        seen = self.newest.get(subject)
        if seen is None or epoch >= seen[0]:
            if seen is not None and epoch > seen[0]:
                log.info("fence: %s now held by %s (epoch %d, was %s at %d)", subject, owner, epoch, seen[1], seen[0])
            self.newest[subject] = (epoch, owner)
            return True
        if self.dropped[owner] % 100 == 0:
            log.warning("fence: dropped a message of %s on %s: its lease epoch %d is older than %s's %d (it lost the lease)",
                        owner, subject, epoch, seen[1], seen[0])
        self.dropped[owner] += 1
        return False
