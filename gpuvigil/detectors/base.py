"""The detector extension point."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from gpuvigil.model import Finding
from gpuvigil.pipeline.window import Window


@runtime_checkable
class Detector(Protocol):
    """A small class (or a function wrapped in one) over windowed frames.

    `detect(window)` looks at the window (all GPUs and ranks at once, with polars expressions)
    and returns the findings that hold *now* (`window.now`). It is called every tick; a cause
    that persists is reported again each tick and the pipeline merges repeats by `cause_key`.
    Detectors keep only small per-cause state (e.g. what was already seen), never raw samples.

    Optional declarations, which bound what the window keeps (pipeline/core.py):
    `lookback_seconds()` → {stream: seconds of `window.get(stream)` it reads; 0 when it reads
    only `window.fresh(stream)`}, and `window_columns()` → {stream: the columns of
    `window.get(stream)` it reads}. A stream is kept as long as its longest reader looks back
    (capped by `pipeline.horizon_seconds`) and its history keeps only the declared columns; a
    reader that declares nothing for a stream keeps all of it, as long as configured.
    """

    name: str

    def detect(self, window: Window) -> list[Finding]: ...
