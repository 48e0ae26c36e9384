"""The collector extension point."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, runtime_checkable

import polars as pl


@runtime_checkable
class Collector(Protocol):
    """A source of frames.

    `streams` declares which streams it emits and their schemas (from `gpuvigil.schemas`);
    `collect(now)` returns the frames gathered since the previous call, keyed by stream name.
    Streams with nothing new may be omitted. A collector never raises for a bad sample: it
    drops it and counts it in `errors`.

    Optional, duck-typed (see `pipeline/health.py`): `health()` → `{target: None | "reason"}`
    says how each target (endpoint, device, file) fared on the latest collect, so a failing one
    is reported loudly; `describe()` → one line for the start-up log; `close()` releases threads,
    child processes and file handles.
    """

    name: str
    streams: Mapping[str, pl.Schema]
    errors: int

    def collect(self, now: float) -> dict[str, pl.DataFrame]: ...
