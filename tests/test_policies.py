"""Shared policies (gpuvigil/policies.py): an XID is as grave online as offline, and only a fault
of the device, never the application's own XID, makes a hang or a timeout a hardware one.

Data: XID events as the kernel-log parser and NVML produce them (codes from gpuvigil/data/xid.yaml),
and the H200 capture's NCCL watchdog timeout (tests/data/h200/s6_nccl_watchdog_timeout.log)."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest

from gpuvigil import schemas

from gpuvigil.collectors.nccl_log import events, parse_lines
from gpuvigil.detectors.watchdog import WatchdogTimeoutDetector
from gpuvigil.detectors.xid import XidDetector
from gpuvigil.offline.analyze import kernel_log_findings
from gpuvigil.window import Window

DATA = Path(__file__).parent / "data"
NOW = 10_000.0
LINE = "NVRM: Xid (PCI:0000:18:00): {code}, pid=1234, name=python, Ch 00000008"


def _xid_event(code: int, node: str = "gvx", ts: float = NOW) -> pl.DataFrame:
    return schemas.frame([{"ts": ts, "node": node, "gpu": 0, "source": "kernel", "kind": "xid", "xid": code, "message": LINE.format(code=code)}], schemas.EVENTS)


def _online(code: int):
    w = Window(3600.0)
    w.add("events", _xid_event(code))
    w.seal(NOW)
    [f] = XidDetector().detect(w)
    return f


def _kernel(code: int):
    return kernel_log_findings(f"Dec  6 10:00:00 gvx kernel: [  100.000000] {LINE.format(code=code)}\n", reference_ts=NOW)


@pytest.mark.parametrize(("code", "severity", "cause"), [(43, "info", "software"), (13, "ticket", "software"), (79, "page", "hardware"), (38, "info", None)])
def test_an_xid_is_as_grave_online_as_offline(code, severity, cause):
    online = _online(code)
    assert (online.severity.value, online.cause) == (severity, cause)
    offline = [f for f in _kernel(code) if f.xid == code]
    assert offline and {(f.severity.value, f.cause) for f in offline} == {(severity, cause)}


def _timeouts() -> pl.DataFrame:
    ev = events(parse_lines((DATA / "h200/s6_nccl_watchdog_timeout.log").read_text().splitlines(), reference_ts=0.0), node="gvx", job="j1")
    ev = ev.filter(pl.col("kind") == "nccl_timeout")
    return ev.with_columns(ts=pl.col("ts") - pl.col("ts").max() + NOW)


@pytest.mark.parametrize(("code", "cause"), [(13, "software"), (31, "software"), (43, "software"), (79, "hardware"), (48, "hardware")])
def test_only_a_device_xid_on_the_node_makes_a_timeout_hardware(code, cause):
    w = Window(3600.0)
    w.add("events", pl.concat([_timeouts(), _xid_event(code, ts=NOW - 30.0)], how="diagonal_relaxed"))
    w.seal(NOW)
    [f] = WatchdogTimeoutDetector().detect(w)
    assert f.cause == cause
