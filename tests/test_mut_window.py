"""Mutation testing of `gpuvigil/pipeline/`: `Window`'s per-stream horizons.

Data: constructed `gpu_samples` rows (the window's own contract).
"""

from __future__ import annotations

from gpuvigil import schemas
from gpuvigil.window import Window


def test_each_stream_keeps_its_own_horizon_and_others_the_default():
    w = Window({"gpu_samples": 60.0, "default": 300.0})
    assert w.horizon("gpu_samples") == 60.0 and w.horizon("events") == 300.0
    assert Window({"events": 10.0}).horizon("jobs") == 600.0 and Window(42.0).horizon("events") == 42.0
    w.add("gpu_samples", schemas.frame([{"ts": t, "node": "n", "gpu": 0} for t in (0.0, 50.0, 100.0)], schemas.GPU_SAMPLES))
    w.add("events", schemas.frame([{"ts": t, "node": "n", "kind": "xid"} for t in (0.0, 50.0, 100.0)], schemas.EVENTS))
    w.seal(100.0)
    assert w.get("gpu_samples")["ts"].to_list() == [50.0, 100.0]
    assert w.get("events")["ts"].to_list() == [0.0, 50.0, 100.0]
