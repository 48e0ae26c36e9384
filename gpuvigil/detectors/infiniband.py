"""InfiniBand / RoCE ports: down or flapping, trained below their rate or width, erroring, missing.

Reads the `ib_ports` stream (collectors/infiniband.py: one row per port and read, from sysfs) and
keeps a few small frames of per-port state, so a tick costs O(the ports it read):

- `ib_link_down`: a port that was ACTIVE (or that the node is expected to have up: `expected_ports`)
  is not (page); or a port that is up again but went down `flap_min_events` times within
  `flap_window_seconds` (its `link_downed` counter rose, or a read saw it leave ACTIVE; ticket). A
  read every few seconds misses most short drops; the counter does not.
- `ib_link_degraded`: an ACTIVE port whose rate or width is below what it should be: the value
  configured for it (`expected`, by device pattern) or, where none is, what most of the node's
  other ports of the same link layer run at (at least `min_peers` of them agree).
- `ib_link_errors`: a port whose symbol, receive, link-integrity (...) errors per minute, measured
  over at least `window_seconds`, reach `error_rates_per_minute`; sooner when the errors counted
  since the baseline already exceed what the whole window allows. A counter that went down was
  reset: the reading becomes the new baseline, nothing is reported.
- `ib_port_missing`: a node that has fewer ports than `expected_ports`, or lost a port it had.

Ports of link layers not in `link_layers` or devices matching `exclude_devices` are not watched
(a management RoCE NIC is not the training fabric). A port never seen ACTIVE, with no expected
count, is not "down": the second port of a dual-port HCA often has no cable.

A port's findings name the node and the port (identity: node, device, port), and the GPUs and
jobs it serves where the PCIe topology or NUMA node says so (the row's `gpus`), else every job on
the node: a bad link slows or hangs every job that spans the node.
"""

from __future__ import annotations

import fnmatch
import json
from typing import Any

import polars as pl
from pydantic import BaseModel, Field

from gpuvigil.detectors.base import FRESH, HISTORY, Declared, DetectorSpec
from gpuvigil.detectors.common import settings
from gpuvigil.model import Finding, FindingKind, Severity
from gpuvigil.window import Window

KEY = ["node", "device", "port"]
_ERROR_COUNTERS = (
    "symbol_error",
    "port_rcv_errors",
    "local_link_integrity_errors",
    "link_error_recovery",
    "excessive_buffer_overrun_errors",
    "port_rcv_remote_physical_errors",
)


class PortExpectation(BaseModel):
    rate_gbps: float | None = Field(None, gt=0)
    width: int | None = Field(None, ge=1)


class InfinibandConfig(BaseModel):
    link_layers: list[str] = ["InfiniBand", "Ethernet"]
    exclude_devices: list[str] = []
    # Ports each node should have present and ACTIVE (after the filters above); null: unknown.
    expected_ports: int | None = Field(None, ge=0)
    # Device name pattern (fnmatch, e.g. "mlx5_*") -> rate and width each port should train at.
    expected: dict[str, PortExpectation] = {}
    min_peers: int = Field(2, ge=1)
    flap_window_seconds: float = Field(600.0, gt=0)
    flap_min_events: int = Field(1, ge=1)
    window_seconds: float = Field(60.0, gt=0)
    error_rates_per_minute: dict[str, float] = {
        "symbol_error": 10.0,
        "port_rcv_errors": 10.0,
        "local_link_integrity_errors": 1.0,
        "link_error_recovery": 1.0,
        "excessive_buffer_overrun_errors": 1.0,
        "port_rcv_remote_physical_errors": 10.0,
    }


def _speed(rate: float | None, width: int | None) -> str:
    """'400 Gb/s at 4X', or what of it is known."""
    return " at ".join(p for p in (f"{rate:g} Gb/s" if rate is not None else None, f"{width}X" if width is not None else None) if p) or "an unknown rate"


# What a port's physical state says about a port that is not ACTIVE (the kernel's phys_state
# names, drivers/infiniband/core/sysfs.c; LinkUp with a state below ACTIVE: the subnet manager has
# not brought the port up).
_PHYS_MEANING = {
    "Sleep": "no link: the port is asleep",
    "Polling": "no link: the port polls for a peer; check the cable, the transceiver and the switch port",
    "Disabled": "disabled by software",
    "PortConfigurationTraining": "the link is training",
    "LinkUp": "the link is up but the subnet manager has not activated the port",
    "LinkErrorRecovery": "the link is retraining after errors",
    "Phy Test": "in physical test mode: not in service",
}


def _port(row: dict[str, Any]) -> str:
    return f"{row['device']} port {row['port']}"


class InfinibandDetector(Declared):
    spec = DetectorSpec(
        name="infiniband",
        config=InfinibandConfig,
        emits=(FindingKind.IB_LINK_DOWN, FindingKind.IB_LINK_DEGRADED, FindingKind.IB_LINK_ERRORS, FindingKind.IB_PORT_MISSING),
        reads={"ib_ports": FRESH, "allocations": HISTORY},
        order=125,
        level="L0",
        streams=("ib_ports",),
    )

    def __init__(self, cfg: dict[str, Any] | None = None):
        self.config = settings("infiniband", InfinibandConfig, cfg)
        c = self.config
        unknown = sorted(set(c.error_rates_per_minute) - set(_ERROR_COUNTERS))
        if unknown:
            raise ValueError(f"detectors.infiniband.error_rates_per_minute: unknown counter(s) {', '.join(unknown)} (known: {', '.join(_ERROR_COUNTERS)})")
        self._counters = [k for k in _ERROR_COUNTERS if k in c.error_rates_per_minute]
        key_schema = {"node": pl.Utf8, "device": pl.Utf8, "port": pl.Int32}
        self._prev = pl.DataFrame(schema={**key_schema, "_state": pl.Utf8, "_downed": pl.Int64})
        self._flaps = pl.DataFrame(schema={**key_schema, "ts": pl.Float64, "events": pl.Int64})
        self._ever_active = pl.DataFrame(schema=key_schema)
        self._seen = pl.DataFrame(schema=key_schema)
        self._base = pl.DataFrame(schema={**key_schema, "_ts0": pl.Float64, **{f"_{k}": pl.Int64 for k in self._counters}})
        self._hot = pl.DataFrame(schema={**key_schema, "rates": pl.Utf8, "window_seconds": pl.Float64, "per_minute": pl.Float64, "worst": pl.Utf8})

    # -- per-tick state --------------------------------------------------------------------

    def _watched(self, fresh: pl.DataFrame) -> pl.DataFrame:
        c = self.config
        ports = fresh.filter(pl.col("device").is_not_null() & pl.col("port").is_not_null() & pl.col("node").is_not_null())
        ports = ports.filter(pl.col("link_layer").is_in(c.link_layers) | pl.col("link_layer").is_null())
        if c.exclude_devices:
            devices = [d for d in ports.get_column("device").unique().to_list() if not any(fnmatch.fnmatchcase(d, p) for p in c.exclude_devices)]
            ports = ports.filter(pl.col("device").is_in(devices))
        # one reading per port: its newest
        return ports.sort("ts").unique(KEY, keep="last", maintain_order=True)

    def _fold_flaps(self, ports: pl.DataFrame, now: float) -> None:
        joined = ports.select(*KEY, "ts", "state", pl.col("link_downed")).join(self._prev, on=KEY, how="left")
        rise = (pl.col("link_downed") - pl.col("_downed")).clip(lower_bound=0).fill_null(0)
        left = ((pl.col("_state") == "ACTIVE") & (pl.col("state") != "ACTIVE").fill_null(True)).cast(pl.Int64).fill_null(0)
        events = joined.select(*KEY, "ts", pl.max_horizontal(rise, left).alias("events")).filter(pl.col("events") > 0)
        if events.height:
            self._flaps = pl.concat([self._flaps, events], how="vertical_relaxed")
        self._flaps = self._flaps.filter(pl.col("ts") > now - self.config.flap_window_seconds)
        cur = ports.select(*KEY, pl.col("state").alias("_state"), pl.col("link_downed").alias("_downed"))
        self._prev = pl.concat([self._prev.join(cur.select(KEY), on=KEY, how="anti"), cur], how="vertical_relaxed")
        active = ports.filter(pl.col("state") == "ACTIVE").select(KEY)
        if active.height:
            self._ever_active = pl.concat([self._ever_active, active], how="vertical_relaxed").unique(maintain_order=True)

    def _fold_errors(self, ports: pl.DataFrame) -> None:
        if not self._counters:
            return
        cur = ports.select(*KEY, "ts", *self._counters)
        joined = cur.join(self._base, on=KEY, how="left")
        limits = self.config.error_rates_per_minute
        # Errors since the baseline beyond what the whole window allows: the window's rate is over
        # its limit whatever the rest of it brings, so the verdict need not wait for its end.
        window = self.config.window_seconds
        already = pl.any_horizontal([(pl.col(k) - pl.col(f"_{k}")) >= limits[k] * window / 60.0 for k in self._counters]).fill_null(False)
        due = joined.filter(pl.col("_ts0").is_null() | (pl.col("ts") - pl.col("_ts0") >= window) | (already & (pl.col("ts") > pl.col("_ts0"))))
        if due.height == 0:
            return
        dt = pl.col("ts") - pl.col("_ts0")
        # A counter lower than its baseline was reset (driver reload, counters cleared): no rate.
        rates = [
            pl.when(pl.col(k) >= pl.col(f"_{k}")).then((pl.col(k) - pl.col(f"_{k}")) * 60.0 / dt).alias(f"rate_{k}")
            for k in self._counters
        ]
        over = [pl.when(pl.col(f"rate_{k}") >= limits[k]).then(pl.lit(k)) for k in self._counters]
        based = due.filter(pl.col("_ts0").is_not_null() & (dt > 0)).with_columns(rates)
        verdict = based.with_columns(pl.concat_list(over).list.drop_nulls().alias("_over")).filter(pl.col("_over").list.len() > 0)
        hot = verdict.select(
            *KEY,
            pl.struct([f"rate_{k}" for k in self._counters]).struct.json_encode().alias("rates"),
            dt.alias("window_seconds"),
            pl.max_horizontal([pl.col(f"rate_{k}") / limits[k] for k in self._counters]).alias("per_minute"),
            pl.col("_over").list.join(",").alias("worst"),
        )
        # Re-evaluated ports replace their previous verdict.
        self._hot = pl.concat([self._hot.join(due.select(KEY), on=KEY, how="anti"), hot], how="vertical_relaxed")
        new_base = due.select(*KEY, pl.col("ts").alias("_ts0"), *[pl.col(k).alias(f"_{k}") for k in self._counters])
        self._base = pl.concat([self._base.join(new_base.select(KEY), on=KEY, how="anti"), new_base], how="vertical_relaxed")

    # -- verdicts --------------------------------------------------------------------------

    def _expected(self, ports: pl.DataFrame) -> pl.DataFrame:
        """Each ACTIVE port's expected rate and width: configured, else its peers' majority."""
        c = self.config
        active = ports.filter(pl.col("state") == "ACTIVE")
        peers = []
        for col in ("rate_gbps", "width"):
            counts = active.filter(pl.col(col).is_not_null()).group_by("node", "link_layer", col).len()
            total = counts.group_by("node", "link_layer").agg(pl.col("len").sum().alias("_total"))
            # the value most of the node's ports of this layer have, held by >= min_peers of them
            top = counts.join(total, on=["node", "link_layer"], nulls_equal=True).filter((pl.col("len") * 2 > pl.col("_total")) & (pl.col("len") >= c.min_peers))
            peers.append(top.select("node", "link_layer", pl.col(col).alias(f"peer_{col}")))
        out = active.join(peers[0], on=["node", "link_layer"], how="left", nulls_equal=True).join(peers[1], on=["node", "link_layer"], how="left", nulls_equal=True)
        conf_rate: list[float | None] = []
        conf_width: list[int | None] = []
        for device in out.get_column("device").to_list():
            match = next((e for p, e in c.expected.items() if fnmatch.fnmatchcase(device, p)), None)
            conf_rate.append(match.rate_gbps if match else None)
            conf_width.append(match.width if match else None)
        return out.with_columns(
            pl.coalesce(pl.Series(conf_rate, dtype=pl.Float64), pl.col("peer_rate_gbps")).alias("expected_rate_gbps"),
            pl.coalesce(pl.Series(conf_width, dtype=pl.Int32), pl.col("peer_width")).alias("expected_width"),
            pl.Series([r is not None or w is not None for r, w in zip(conf_rate, conf_width, strict=True)], dtype=pl.Boolean).alias("configured"),
        )

    def _jobs(self, window: Window) -> pl.DataFrame:
        """(node, gpu) -> job from the scheduler's placements."""
        alloc = window.get("allocations")
        if alloc.height == 0 or "job" not in alloc.columns:
            return pl.DataFrame(schema={"node": pl.Utf8, "gpu": pl.Int32, "job": pl.Utf8})
        return alloc.select("node", pl.col("gpu").cast(pl.Int32), "job").filter(pl.col("job").is_not_null())

    def _attribution(self, row: dict[str, Any], jobs: pl.DataFrame) -> tuple[list[str], int | None]:
        gpus = [int(g) for g in (row.get("gpus") or [])]
        on_node = jobs.filter(pl.col("node") == row["node"])
        if gpus:
            on_node = on_node.filter(pl.col("gpu").is_in(gpus))
        names = sorted(set(on_node.get_column("job").to_list()))
        return names, (gpus[0] if len(gpus) == 1 and row.get("affinity") == "pcie" else None)

    def _finding(self, kind: FindingKind, severity: Severity, row: dict[str, Any], now: float, jobs: pl.DataFrame, evidence: dict[str, Any], summary: str) -> Finding:
        names, gpu = self._attribution(row, jobs) if row.get("device") is not None else (sorted(set(jobs.filter(pl.col("node") == row["node"]).get_column("job").to_list())), None)
        return Finding(
            kind=kind,
            severity=severity,
            ts=now,
            job=names[0] if len(names) == 1 else None,
            node=row["node"],
            gpu=gpu,
            cause="hardware",
            source=self.name,
            evidence={
                # the port's identity (kinds.py): node/device/port, or the node for its missing ports
                "port_id": "/".join(str(p) for p in (row["node"], row.get("device"), row.get("port")) if p is not None),
                "device": row.get("device"),
                "port": row.get("port"),
                "link_layer": row.get("link_layer"),
                "gpus": [int(g) for g in (row.get("gpus") or [])],
                "affinity": row.get("affinity") or "node",
                "jobs": names,
                **evidence,
            },
            summary=summary + (f" Jobs on it: {', '.join(names)}." if names else ""),
        )

    def detect(self, window: Window) -> list[Finding]:
        fresh = window.fresh("ib_ports")
        if fresh.height == 0 or "device" not in fresh.columns:
            return []
        now = window.now
        c = self.config
        ports = self._watched(fresh)
        self._fold_flaps(ports, now)
        self._fold_errors(ports)
        jobs = self._jobs(window)
        findings: list[Finding] = []

        # -- down, or flapping -------------------------------------------------------------
        flaps = self._flaps.group_by(KEY).agg(pl.col("events").sum().alias("flaps"))
        ever = self._ever_active.with_columns(pl.lit(True).alias("_was_active"))
        counts = ports.group_by("node").agg((pl.col("state") == "ACTIVE").sum().alias("_active"))
        state = ports.join(flaps, on=KEY, how="left").join(ever, on=KEY, how="left").join(counts, on="node", how="left")
        short = pl.lit(c.expected_ports is not None) & (pl.col("_active") < (c.expected_ports or 0))
        down = (pl.col("state") != "ACTIVE").fill_null(True) & (pl.col("_was_active").fill_null(False) | short)
        flapping = (pl.col("state") == "ACTIVE") & (pl.col("flaps").fill_null(0) >= c.flap_min_events)
        for row in state.filter(down | flapping).sort(KEY).iter_rows(named=True):
            is_down = row["state"] != "ACTIVE"
            ev = {"state": row["state"], "phys_state": row["phys_state"], "link_downed": row["link_downed"], "flapping": not is_down,
                  "events_in_window": int(row["flaps"] or 0), "flap_window_seconds": c.flap_window_seconds}
            if is_down:
                meaning = _PHYS_MEANING.get(row["phys_state"] or "")
                why = "it was ACTIVE" if row["_was_active"] else f"the node should have {c.expected_ports} ports up"
                summary = (f"InfiniBand link down on {row['node']} {_port(row)}: state {row['state'] or 'unreadable'}, physical {row['phys_state'] or 'unreadable'}"
                           f" ({f'{meaning}; ' if meaning else ''}{why}): cordon the node; jobs spanning it stall or fail.")
            elif int(row["flaps"]) == 1:
                summary = (f"InfiniBand link dropped on {row['node']} {_port(row)}: it went down and came back within the last {c.flap_window_seconds:g} s"
                           f" (link_downed {row['link_downed']}): collectives in flight across the node may have failed; check the cable and transceiver.")
            else:
                summary = (f"InfiniBand link flapping on {row['node']} {_port(row)}: down {int(row['flaps'])} times in the last {c.flap_window_seconds:g} s"
                           f" (link_downed {row['link_downed']}): reseat or replace the cable or transceiver; cordon the node meanwhile.")
            findings.append(self._finding(FindingKind.IB_LINK_DOWN, Severity.PAGE if is_down else Severity.TICKET, row, now, jobs, ev, summary))

        # -- below the expected rate or width ----------------------------------------------
        exp = self._expected(ports)
        slow = (pl.col("rate_gbps") < pl.col("expected_rate_gbps")).fill_null(False) | (pl.col("width") < pl.col("expected_width")).fill_null(False)
        for row in exp.filter(slow).sort(KEY).iter_rows(named=True):
            ev = {"rate_gbps": row["rate_gbps"], "width": row["width"], "speed": row["speed"], "expected_rate_gbps": row["expected_rate_gbps"],
                  "expected_width": row["expected_width"], "expected_from": "config" if row["configured"] else "peers"}
            summary = (f"InfiniBand link below its expected speed on {row['node']} {_port(row)}: {_speed(row['rate_gbps'], row['width'])}"
                       f" where {_speed(row['expected_rate_gbps'], row['expected_width'])} is expected ({'configured' if row['configured'] else 'its peers on the node'}):"
                       " a link trained at half width halves every collective across the node; check the cable and retrain the link.")
            findings.append(self._finding(FindingKind.IB_LINK_DEGRADED, Severity.TICKET, row, now, jobs, ev, summary))

        # -- error rates ---------------------------------------------------------------------
        if self._hot.height:
            hot = self._hot.join(ports, on=KEY, how="inner")
            for row in hot.sort(KEY).iter_rows(named=True):
                rates = {k.removeprefix("rate_"): (round(v, 2) if v is not None else None) for k, v in json.loads(row["rates"]).items()}
                over = row["worst"].split(",")
                ev = {"errors_per_minute": json.dumps(rates, sort_keys=True), "over": over, "window_seconds": round(row["window_seconds"], 1),
                      **{k: row[k] for k in over}}
                detail = ", ".join(f"{k} {rates[k]:g}/min (limit {c.error_rates_per_minute[k]:g})" for k in over)
                summary = f"InfiniBand link errors on {row['node']} {_port(row)}: {detail}: the link is degrading; check the cable and transceiver, and cordon the node if it persists."
                findings.append(self._finding(FindingKind.IB_LINK_ERRORS, Severity.TICKET, row, now, jobs, ev, summary))

        # -- missing ports -------------------------------------------------------------------
        read_nodes = fresh.filter(pl.col("node").is_not_null()).get_column("node").unique().to_list()
        if read_nodes:
            present = ports.select(KEY)
            gone = self._seen.filter(pl.col("node").is_in(read_nodes)).join(present, on=KEY, how="anti")
            self._seen = pl.concat([self._seen, present], how="vertical_relaxed").unique(maintain_order=True)
            have = present.group_by("node").len()
            for node in sorted(read_nodes):
                lost = gone.filter(pl.col("node") == node).sort(KEY)
                n = int(have.filter(pl.col("node") == node).get_column("len").sum() or 0)
                short_ports = c.expected_ports is not None and n < c.expected_ports
                if lost.height == 0 and not short_ports:
                    continue
                names = [f"{d}/{p}" for d, p in lost.select("device", "port").iter_rows()]
                ev = {"ports_present": n, "expected_ports": c.expected_ports, "lost": names}
                summary = (f"InfiniBand ports missing on {node}: {n} present" + (f" of {c.expected_ports} expected" if c.expected_ports is not None else "")
                           + (f"; gone since the last read: {', '.join(names)}" if names else "")
                           + ": an HCA fell off the bus or its driver failed; drain the node and check the adapter.")
                findings.append(self._finding(FindingKind.IB_PORT_MISSING, Severity.PAGE, {"node": node, "device": None, "port": None}, now, jobs, ev, summary))
        return findings


__all__ = ["InfinibandConfig", "InfinibandDetector", "PortExpectation"]
