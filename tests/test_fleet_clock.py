"""The fleet's data clock is bounded by the receiver's own clock (gpuvigil.fleet.clock): a time too
far ahead is counted and ignored, never a jump; lag and skew are what /metrics exports. Driven with
explicit wall and monotonic clocks; the clock on a real NATS cluster runs in tests/test_fleet_e2e.py."""

from __future__ import annotations

import math

import pytest

from gpuvigil.config.deploy import Fleet
from gpuvigil.fleet.clock import BoundedClock, from_fleet
from gpuvigil.fleet.metrics import clock_families


class Clocks:
    def __init__(self, wall: float = 1_800_000_000.0):
        self.w, self.m = wall, 100.0

    def wall(self) -> float:
        return self.w

    def mono(self) -> float:
        return self.m

    def advance(self, s: float) -> None:
        self.w += s
        self.m += s


@pytest.mark.parametrize(
    ("offset", "taken"),
    [(-3600.0, True), (-1.0, True), (0.0, True), (14.9, True), (15.1, False), (3600.0, False)],
)
def test_wall_origin_takes_times_within_the_skew(offset, taken):
    c = Clocks()
    clock = BoundedClock(15.0, "wall", wall=c.wall, mono=c.mono)
    assert clock.offer(c.w - 10.0, "gv.clock.n1")
    assert clock.offer(c.w + offset, "gv.clock.n2") is taken
    assert clock.now == (max(c.w - 10.0, c.w + offset) if taken else c.w - 10.0)
    assert sum(clock.future.values()) == (0 if taken else 1)


def test_a_future_stamp_is_counted_never_a_jump_and_the_clock_goes_on(caplog):
    c = Clocks()
    clock = BoundedClock(15.0, "wall", wall=c.wall, mono=c.mono)
    for _ in range(3):
        assert clock.offer(c.w, "gv.clock.n1")
        assert not clock.offer(c.w + 3600.0, "gv.clock.evil")
        assert not clock.offer(c.w + 3600.0, "gv.part.3.j (node evil)", "rows")
        c.advance(1.0)
    assert clock.now == c.w - 1.0  # the honest agent's last time, not the forged hour
    assert clock.future == {"clock": 3, "rows": 3}
    # Logged once per kind of message (within LOG_EVERY_SECONDS), counted every time.
    assert sum("ahead of this process's clock" in r.getMessage() for r in caplog.records) == 2
    assert clock.skew() == pytest.approx(3600.0)
    assert clock.lag() == pytest.approx(1.0)
    for bad in ("x", None, float("nan"), float("inf")):
        assert not clock.offer(bad, "gv.clock.n1")
    assert clock.bad == 4 and clock.now == c.w - 1.0


def test_data_origin_anchors_then_runs_at_the_rate_and_follows_a_slow_fleet_down():
    c = Clocks()
    clock = BoundedClock(10.0, "data", rate=4.0, wall=c.wall, mono=c.mono)
    assert math.isnan(clock.reference()) and math.isnan(clock.lag())
    assert clock.offer(0.0, "gv.clock.n1")
    c.advance(5.0)  # reference: 20 data s
    assert clock.offer(20.0, "gv.clock.n1")
    assert clock.offer(29.0, "gv.clock.n1")  # 9 s ahead: within the skew
    assert not clock.offer(31.0, "gv.clock.evil")
    assert not clock.offer(3600.0, "gv.clock.evil")
    assert clock.now == 29.0
    # The simulator falls behind (a loaded machine): 60 wall s later it only reached 40 s. The
    # reference follows it down, so a forged stamp can lead the clock by the skew at most, not by
    # the lag that built up (reference 260 s).
    c.advance(60.0)
    assert clock.offer(40.0, "gv.clock.n1")
    assert clock.reference() == pytest.approx(40.0)
    assert not clock.offer(200.0, "gv.clock.evil")
    assert clock.offer(41.0, "gv.clock.n1") and clock.now == 41.0
    # A stamp inside the bound is taken, but never moves the reference (40) forward: repeating it
    # cannot walk the clock past reference + skew.
    for _ in range(5):
        clock.offer(clock.now + 9.0, "gv.clock.evil")
    assert clock.now == 50.0
    assert clock.future["clock"] == 3 + 4


def test_config_and_metrics():
    clock = from_fleet(Fleet(clock_max_skew_seconds=5, clock_origin="data", clock_rate=2))
    assert (clock.max_skew, clock.origin, clock.rate) == (5, "data", 2)
    assert from_fleet(Fleet()).origin == "wall"
    with pytest.raises(ValueError):
        Fleet(clock_origin="ntp")
    c = Clocks()
    clock = BoundedClock(15.0, "wall", wall=c.wall, mono=c.mono)
    clock.offer(c.w - 2.0, "gv.clock.n1")
    clock.offer(c.w + 600.0, "gv.findings.part.1", "findings")
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for fam in clock_families("act", clock, {"replica": "a1"}) for s in fam.samples}
    assert samples[("gpuvigil_act_clock_lag_seconds", (("replica", "a1"),))] == pytest.approx(2.0)
    assert samples[("gpuvigil_act_clock_skew_seconds", (("replica", "a1"),))] == pytest.approx(600.0)
    assert samples[("gpuvigil_act_clock_future_messages_total", (("message", "findings"), ("replica", "a1")))] == 1
