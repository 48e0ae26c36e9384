"""The fleet's data clock, bounded by the receiver's own clock.

Detect and act tick on data time: the times the agents stamp on their clock announcements
(`gv.clock.<node>`), their rows (`Gv-Now`) and the findings messages. One message stamped far in
the future must not move that clock (every finding would look stale, act would clear and re-raise
what is active, and nothing new would be judged until real time caught up). So a time is taken only
when it lies within `clock_max_skew_seconds` of the receiver's own reference clock; a later one is
counted, logged and ignored with its message, never a jump.

The reference clock (`fleet.clock_origin`):

- `wall`: the receiver's own wall clock (`time.time()`), for real fleets whose data time is epoch
  seconds from NTP-synced hosts;
- `data`: a simulation's data time, which starts at 0 and runs at `clock_rate` data seconds per
  wall second (`gpuvigil agent --speed N`). The first time heard anchors it, and it then advances
  at `clock_rate` with the receiver's monotonic clock. When the fleet runs slower than that (a
  loaded simulator), the reference is pulled back to the clock, so the bound stays the skew and
  never grows with accumulated lag; it is never pushed forward by a message.

Lag (the reference minus the clock: how far the fleet's data trails this process) and skew (the
largest offset of a time heard in the last minute from the reference) are exported by
`gpuvigil.fleet.metrics`, with Prometheus rules when they are high.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections import Counter
from typing import Any

log = logging.getLogger("gpuvigil.fleet")
SKEW_WINDOW_SECONDS = 60.0  # the skew gauge is the largest offset heard over this much wall time
LOG_EVERY_SECONDS = 10.0  # one warning per kind of message this often at most: a flood of bad stamps is counted, not logged each


class BoundedClock:
    def __init__(self, max_skew: float, origin: str = "wall", rate: float = 1.0, *, wall: Any = time.time, mono: Any = time.monotonic):
        if origin not in ("wall", "data"):
            raise ValueError(f"clock origin {origin!r}: expected 'wall' or 'data'")
        self.max_skew = max_skew
        self.origin = origin
        self.rate = rate
        self._wall = wall
        self._mono = mono
        self.now = float("-inf")
        self._anchor: tuple[float, float] | None = None  # (data time, monotonic) of the reference
        self.future: Counter[str] = Counter()  # message kind → times refused as too far ahead
        self.bad = 0  # times that were no number
        self._bucket, self._cur, self._prev = -1, math.nan, math.nan  # largest offsets heard, per minute
        self._logged: dict[str, float] = {}

    def reference(self) -> float:
        """This process's own clock in data time (NaN before a `data` clock has heard anything)."""
        if self.origin == "wall":
            return float(self._wall())
        if self._anchor is None:
            return math.nan
        t0, m0 = self._anchor
        return t0 + self.rate * (self._mono() - m0)

    def offer(self, t: Any, source: str, kind: str = "clock") -> bool:
        """Take `t` (seconds) heard from `source` (a subject or node, for the log) on a message of
        `kind` (clock, rows, findings: the metric's label) if it is not too far ahead; False when
        refused (the caller then ignores the message it came with)."""
        try:
            t = float(t)
        except (TypeError, ValueError):
            self.bad += 1
            return False
        if not math.isfinite(t):
            self.bad += 1
            return False
        ref = self.reference()
        if self.origin == "data" and self._anchor is None:
            self._anchor, ref = (t, self._mono()), t
        offset = t - ref
        self._note_skew(offset)
        if offset > self.max_skew:
            self.future[kind] += 1
            m = self._mono()
            if m - self._logged.get(kind, float("-inf")) >= LOG_EVERY_SECONDS:
                self._logged[kind] = m
                log.warning("clock: %s message from %s stamped %.1f, %.1fs ahead of this process's clock (bound %gs): ignored (%d %s messages so far)",
                            kind, source, t, offset, self.max_skew, self.future[kind], kind)
            return False
        if t > self.now:
            self.now = t
        if self.origin == "data" and ref - self.now > self.max_skew:
            # The fleet runs slower than clock_rate: the reference follows it down, so that a
            # stamp can lead the clock by the skew at most, whatever lag has built up.
            self._anchor = (self.now, self._mono())
        return True

    def _note_skew(self, offset: float) -> None:
        # Two buckets of SKEW_WINDOW_SECONDS (this one and the last): bounded memory at any rate.
        b = int(self._mono() // SKEW_WINDOW_SECONDS)
        if b != self._bucket:
            self._prev = self._cur if b == self._bucket + 1 else math.nan
            self._bucket, self._cur = b, math.nan
        if not abs(offset) <= abs(self._cur):  # also true while _cur is NaN
            self._cur = offset

    def skew(self) -> float:
        """The largest offset from the reference heard in the last one to two minutes (positive:
        ahead; NaN when nothing was heard)."""
        b = int(self._mono() // SKEW_WINDOW_SECONDS)
        cands = [self._cur] if b == self._bucket else []
        if b in (self._bucket, self._bucket + 1):
            cands.append(self._prev if b == self._bucket else self._cur)
        cands = [c for c in cands if not math.isnan(c)]
        return max(cands, key=abs) if cands else math.nan

    def lag(self) -> float:
        """How far the fleet's data clock trails this process's own clock (NaN before any time)."""
        ref = self.reference()
        return ref - self.now if math.isfinite(ref) and math.isfinite(self.now) else math.nan

    async def subscribe(self, nc: Any, subjects: Any) -> Any:
        """The agents' clock announcements (`<prefix>.clock.<node>`; core NATS, not stored)."""

        async def on(msg: Any) -> None:
            try:
                t = json.loads(msg.data)["now"]
            except (ValueError, KeyError, TypeError):
                self.bad += 1
                return
            self.offer(t, msg.subject, "clock")

        return await nc.subscribe(f"{subjects.prefix}.clock.>", cb=on)


def from_fleet(fleet: Any) -> BoundedClock:
    return BoundedClock(fleet.clock_max_skew_seconds, fleet.clock_origin, fleet.clock_rate)
