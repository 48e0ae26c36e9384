"""The detector extension point: the Protocol a detector follows and the declaration it makes.

A detector class declares what it is with a class attribute `spec = DetectorSpec(...)`: its
name, config model, observation level and capability, the streams (and columns) it reads and how
far back, and the finding kinds it emits. Declaring it is registering it: the registry
(detectors/registry.py) collects every class of `gpuvigil/detectors/` that has a spec, and the
config section, the default set and its order, level selection, the fleet's placement and what
the window keeps derive from the declarations. tests/test_detector_contract.py holds every
registered detector to its declaration.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Protocol, runtime_checkable

from pydantic import BaseModel

from gpuvigil.kinds import POLICIES, FindingKind
from gpuvigil.model import Finding
from gpuvigil.window import Window

LEVELS = ("L0", "L1", "L2")
# Where a detector runs: the fleet's node agent, a detect replica or the act leader (serve and
# replay run all three), or `offline`: it judges what only an artefact read after the fact holds
# (a whole kernel log's XID incidents, a memory snapshot, a saved reading), and only `analyze`
# runs it. A detector judging a stream a live source fills is never offline.
Placement = Literal["agent", "detect", "act", "offline"]
LIVE_PLACEMENTS: tuple[Placement, ...] = ("agent", "detect", "act")


@dataclass(frozen=True)
class Reads:
    """What a detector reads of one stream.

    `history`: False when it reads only each tick's fresh rows (`window.fresh`): look-back 0, so
    it neither lengthens the stream's horizon nor keeps its columns. `lookback_seconds`: how far
    back it reads `window.get` (None: the configured horizon, or its own `lookback_seconds()`
    when the look-back follows its config). `columns`: the columns it reads, key columns
    included (None: any)."""

    history: bool = True
    lookback_seconds: float | None = None
    columns: tuple[str, ...] | None = None


FRESH = Reads(history=False)
HISTORY = Reads()


@dataclass(frozen=True)
class DetectorSpec:
    """A detector's declaration (see the module's doc).

    `streams`: the per-job streams that mark a job as observable by it (level selection,
    pipeline/levels.py); defaults to every stream it reads. `order`: its place in the default
    set (detectors run, and their findings are placed, in this order). `every_seconds`: how often
    it runs by default (`pipeline.detector_every_seconds` overrides; 0 every tick)."""

    name: str
    config: type[BaseModel]
    emits: tuple[FindingKind, ...]
    reads: Mapping[str, Reads]
    order: int
    level: str = "L0"
    capability: str | None = None
    streams: tuple[str, ...] | None = None
    every_seconds: float = 0.0
    placement_override: Placement | None = field(default=None)

    def __post_init__(self) -> None:
        if self.level not in LEVELS:
            raise ValueError(f"detector {self.name}: level {self.level!r} is not one of {LEVELS}")
        if not self.emits:
            raise ValueError(f"detector {self.name}: emits no finding kind")
        if not self.reads:
            raise ValueError(f"detector {self.name}: reads no stream")

    @property
    def level_streams(self) -> tuple[str, ...]:
        return tuple(self.reads) if self.streams is None else self.streams

    @property
    def placement(self) -> Placement:
        """Where it runs in the fleet: the node agent when every kind it emits is about one GPU or
        node (it needs no other node's rows), the act leader when one is about the whole cluster,
        else a detect replica (per job partition); `offline` only when declared so."""
        if self.placement_override is not None:
            return self.placement_override
        scopes = {POLICIES[k].scope for k in self.emits}
        if "cluster" in scopes:
            return "act"
        return "agent" if scopes <= {"gpu", "node"} else "detect"

    def lookback(self) -> dict[str, float]:
        """The look-backs it declares: 0 for fresh-only streams, the given seconds for others."""
        out: dict[str, float] = {}
        for stream, r in self.reads.items():
            if not r.history:
                out[stream] = 0.0
            elif r.lookback_seconds is not None:
                out[stream] = float(r.lookback_seconds)
        return out

    def history_columns(self) -> dict[str, tuple[str, ...]]:
        return {s: r.columns for s, r in self.reads.items() if r.history and r.columns is not None}


@runtime_checkable
class Detector(Protocol):
    """A small class (or a function wrapped in one) over windowed frames.

    `detect(window)` looks at the window (all GPUs and ranks at once, with polars expressions)
    and returns the findings that hold *now* (`window.now`). It is called every tick; a cause
    that persists is reported again each tick and the pipeline merges repeats by `cause_key`.
    Detectors keep only small per-cause state (e.g. what was already seen), never raw samples.

    Declarations that bound what the window keeps (pipeline/core.py), derived from `spec` unless
    the class defines them (a look-back that follows its config):
    `lookback_seconds()` → {stream: seconds of `window.get(stream)` it reads; 0 when it reads
    only `window.fresh(stream)`}, and `window_columns()` → {stream: the columns of
    `window.get(stream)` it reads}. A stream is kept as long as its longest reader looks back
    (capped by `pipeline.horizon_seconds`) and its history keeps only the declared columns; a
    reader that declares nothing for a stream keeps all of it, as long as configured.
    """

    name: str

    def detect(self, window: Window) -> list[Finding]: ...


class Declared:
    """Base of a declared detector: its `name`, `level`, `capability` and level `streams` are its
    spec's, and, unless it defines its own, `lookback_seconds()` and `window_columns()` say what
    its spec's `reads` say. Subclassing it with a `spec` is all a detector needs to register."""

    spec: ClassVar[DetectorSpec]
    name: ClassVar[str]
    level: ClassVar[str]
    capability: ClassVar[str | None]
    streams: ClassVar[tuple[str, ...]]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        spec = cls.__dict__.get("spec")
        if not isinstance(spec, DetectorSpec):
            return
        cls.name, cls.level, cls.capability, cls.streams = spec.name, spec.level, spec.capability, spec.level_streams
        if "lookback_seconds" not in cls.__dict__ and spec.lookback():
            cls.lookback_seconds = lambda self: spec.lookback()  # type: ignore[attr-defined]
        if "window_columns" not in cls.__dict__ and spec.history_columns():
            cls.window_columns = lambda self: spec.history_columns()  # type: ignore[attr-defined]
