"""`oom_events` reports each OOM exactly once whatever its arrival lateness: a log line read after
a delay (its ts before the previous tick) is still reported, the same line read twice is not
reported again, and the usual in-order arrival is unchanged.

Sources: the unedited H200 OOM messages of tests/data/h200/s2_oom_ramp.log (capacity) and
s3_fragmentation.log (fragmentation); node/GPU/job/rank and times are constructed."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuvigil import schemas
from gpuvigil.detectors.oom_events import OomEventClassifier
from gpuvigil.window import Window

DATA = Path(__file__).parent / "data" / "h200"


def _captured(name: str) -> str:
    text = (DATA / name).read_text()
    return text.split("OOM_MESSAGE_BEGIN\n", 1)[1].split("\nOOM_MESSAGE_END", 1)[0]


MSG = {"cap": _captured("s2_oom_ramp.log"), "frag": _captured("s3_fragmentation.log")}


def row(ts: float, msg: str, rank: int) -> dict:
    return {"ts": ts, "node": "node-7", "gpu": rank, "source": "torch", "kind": "oom", "job": "train", "rank": rank, "message": MSG[msg]}


# Each case: ticks of (now, rows arriving before that tick) and, per tick, the (ts, rank, kind)
# reported on it.
CASES = {
    "in order": (
        [(100.0, [row(95.0, "cap", 0)]), (101.0, [row(100.5, "frag", 1)]), (102.0, [])],
        [[(95.0, 0, "oom_capacity")], [(100.5, 1, "oom_fragmentation")], []],
    ),
    "late line, ts before the previous tick": (
        [(100.0, [row(95.0, "cap", 0)]), (101.0, []), (102.0, [row(96.0, "frag", 1)]), (103.0, [])],
        [[(95.0, 0, "oom_capacity")], [], [(96.0, 1, "oom_fragmentation")], []],
    ),
    "late line minutes late, still within report_seconds": (
        [(1000.0, []), (1001.0, [row(700.0, "cap", 2)]), (1002.0, [])],
        [[], [(700.0, 2, "oom_capacity")], []],
    ),
    "line older than report_seconds when it arrives": (
        [(1000.0, []), (1001.0, [row(400.0, "cap", 2)])],
        [[], []],
    ),
    "same line read twice, in one tick and on a later one": (
        [(100.0, [row(95.0, "cap", 0), row(95.0, "cap", 0)]), (101.0, [row(95.0, "cap", 0)]), (102.0, [])],
        [[(95.0, 0, "oom_capacity")], [], []],
    ),
    "same message, another rank at the same time: two OOMs": (
        [(100.0, [row(95.0, "cap", 0)]), (101.0, [row(95.0, "cap", 1)])],
        [[(95.0, 0, "oom_capacity")], [(95.0, 1, "oom_capacity")]],
    ),
}


@pytest.mark.parametrize("ticks, expected", CASES.values(), ids=CASES.keys())
def test_each_oom_reported_once_whatever_its_lateness(ticks, expected):
    det = OomEventClassifier()  # report_seconds 600 (config default)
    w = Window(3600.0)  # the events horizon of config/pipeline.yaml
    got = []
    for now, rows in ticks:
        if rows:
            w.add("events", schemas.frame(rows, schemas.EVENTS))
        w.seal(now)
        got.append([(f.ts, f.ranks[0], f.kind.value) for f in det.detect(w)])
    assert got == expected


def test_not_due_every_tick_still_reports_each_once():
    """A classifier run every other tick (pipeline.detector_every_seconds) sees the events that
    arrived while it was not due, late or not, once."""
    det = OomEventClassifier()
    w = Window(3600.0)
    w.add("events", schemas.frame([row(95.0, "cap", 0)], schemas.EVENTS))
    w.seal(100.0)
    assert [f.ranks for f in det.detect(w)] == [[0]]
    w.add("events", schemas.frame([row(100.5, "frag", 1)], schemas.EVENTS))
    w.seal(101.0)  # not due
    w.add("events", schemas.frame([row(90.0, "frag", 2), row(95.0, "cap", 0)], schemas.EVENTS))
    w.seal(102.0)
    assert sorted(f.ranks[0] for f in det.detect(w)) == [1, 2]
    w.seal(103.0)
    assert det.detect(w) == []
