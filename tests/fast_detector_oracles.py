"""The per-GPU detectors as they were before their state moved to numpy slots (thermal, pcie,
hang_device) and before ECC's quiet-tick shortcut: verbatim copies of their frame-join code. The fast detectors
must give the same findings, in the same order, on the same rows
(tests/test_detectors_fast_oracles.py).

Two changes are applied to both: a throttled GPU without a temperature reading crashed the
summary; a failed row remap (the flag, or XID 64) is its own kind, `row_remap_failure`.
"""

from __future__ import annotations

from typing import Any

import polars as pl

from gpuvigil.gpu import throttle
from gpuvigil.gpu import xid as xid_table
# `settings` reads the shipped configuration and `rank_at` words a summary: shared so that the
# comparison is about what is found. The joins and number handling below are the oracle's own.
from gpuvigil.detectors.common import rank_at, settings
from gpuvigil.detectors.ecc import EccConfig
from gpuvigil.detectors.hang_device import HangDeviceConfig
from gpuvigil.detectors.pcie import PcieConfig
from gpuvigil.detectors.thermal import ThermalConfig
from gpuvigil.model import Finding, FindingKind, Severity
from gpuvigil.window import Window

def gpu_jobs(window: Window) -> pl.DataFrame:
    """(node, gpu) → job, rank of the scheduler's allocation snapshot."""
    return window.get("allocations").select("node", "gpu", "job", "rank")


def _nz(col: str) -> pl.Expr:
    return pl.col(col).fill_null(0.0)


def _r(v: Any) -> float | None:
    """Three decimals, or None for a missing or NaN reading."""
    if v is None or (isinstance(v, float) and v != v):
        return None
    return round(float(v), 3)


class JoinThermal:
    name = "thermal"

    def __init__(self, cfg: dict[str, Any] | None = None):
        self.config = settings("thermal", ThermalConfig, cfg)
        self._state: pl.DataFrame | None = None

    def _update(self, window: Window) -> pl.DataFrame:
        """Per GPU: an exponentially weighted share of recent samples that were throttled
        (time constant `window_seconds`), updated from this tick's samples only."""
        c = self.config
        fresh = window.fresh("gpu_samples").filter(pl.col("throttle_reasons").is_not_null()).select(
            "node", "gpu", "ts", "temperature_c", "sm_clock_mhz", "power_w", pl.col("throttle_reasons").alias("reasons"),
            ((pl.col("throttle_reasons") & c.reason_mask) != 0).cast(pl.Float64).alias("_hit"),
        )
        # One row per GPU: a tick may bring several samples of one GPU (a fast sampler, or NVML
        # and DCGM both on); joined row by row they would multiply the state every tick.
        fresh = fresh.sort("ts").group_by(["node", "gpu"], maintain_order=True).agg(
            pl.col("ts", "temperature_c", "sm_clock_mhz", "power_w", "reasons").last(), pl.col("_hit").mean()
        )
        if self._state is None:
            state = fresh.with_columns(pl.col("_hit").alias("share"), pl.lit(1).alias("n"))
        else:
            prev = self._state.select("node", "gpu", pl.col("ts").alias("_pts"), pl.col("share").alias("_ps"), pl.col("n").alias("_pn"))
            alpha = 1.0 - (-(pl.col("ts") - pl.col("_pts")) / c.window_seconds).exp()
            updated = fresh.join(prev, on=["node", "gpu"], how="left").with_columns(
                pl.when(pl.col("_ps").is_null()).then(pl.col("_hit")).otherwise(alpha * pl.col("_hit") + (1 - alpha) * pl.col("_ps")).alias("share"),
                (pl.col("_pn").fill_null(0) + 1).alias("n"),
            ).drop("_pts", "_ps", "_pn")
            kept = self._state.join(fresh.select("node", "gpu"), on=["node", "gpu"], how="anti")
            state = pl.concat([kept, updated], how="vertical_relaxed")
        self._state = state
        return state

    def detect(self, window: Window) -> list[Finding]:
        c = self.config
        now = window.now
        state = self._update(window)
        hot = (
            state.filter((pl.col("n") >= c.min_samples) & (pl.col("share") >= c.min_throttled_share) & (pl.col("_hit") > 0))
            .rename({"temperature_c": "max_temp", "sm_clock_mhz": "clock", "power_w": "power"})
            .join(gpu_jobs(window), on=["node", "gpu"], how="left")
        )
        findings = []
        for row in hot.iter_rows(named=True):
            reasons = int(row["reasons"] or 0)
            kinds = throttle.active(reasons, c.reason_mask, short=True)
            findings.append(
                Finding(
                    kind=FindingKind.THERMAL_THROTTLE,
                    severity=Severity.TICKET,
                    ts=now,
                    job=row["job"],
                    ranks=[int(row["rank"])] if row["rank"] is not None else [],
                    node=row["node"],
                    gpu=row["gpu"],
                    cause="hardware",
                    source=self.name,
                    evidence={
                        "throttled_share": round(float(row["share"]), 2),
                        "max_temperature_c": float(row["max_temp"] or 0),
                        "sm_clock_mhz": float(row["clock"] or 0),
                        "reasons": kinds,
                        "reasons_bitmask": reasons,
                        "power_w": round(float(row["power"] or 0), 1),
                    },
                    summary=(
                        f"{row['node']} GPU {row['gpu']} is throttling ({', '.join(kinds) or 'clock events'})"
                        # a replay may have clock-event reasons but no temperature series
                        + (f" at {row['max_temp']:.0f} °C" if row["max_temp"] is not None else "")
                        + f", SM clock {row['clock'] or 0:.0f} MHz"
                        + (f", slowing job {row['job']} rank {row['rank']}" if row["job"] else "")
                        + ": check its cooling."
                    ),
                )
            )
        return findings


class JoinPcie:
    name = "pcie"

    def __init__(self, cfg: dict[str, Any] | None = None):
        self.config = settings("pcie", PcieConfig, cfg)
        self._base: pl.DataFrame | None = None
        self._flagged: pl.DataFrame | None = None

    def detect(self, window: Window) -> list[Finding]:
        c = self.config
        fresh = window.fresh("gpu_samples").filter(pl.col("pcie_replay_total").is_not_null()).select("node", "gpu", "ts", pl.col("pcie_replay_total").alias("count"))
        # One row per GPU (its latest reading): several samples of one GPU in a tick would
        # otherwise multiply the baseline rows on every join.
        fresh = fresh.sort("ts").group_by(["node", "gpu"], maintain_order=True).last()
        if fresh.height:
            if self._base is None:
                self._base = fresh
            else:
                joined = fresh.join(self._base.rename({"ts": "ts0", "count": "count0"}), on=["node", "gpu"], how="left")
                due = joined.filter(pl.col("ts0").is_null() | (pl.col("ts") - pl.col("ts0") >= c.window_seconds))
                if due.height:
                    rated = due.filter(pl.col("ts0").is_not_null()).with_columns(
                        ((pl.col("count") - pl.col("count0")) * 60.0 / (pl.col("ts") - pl.col("ts0"))).alias("per_minute")
                    )
                    hot = rated.filter(pl.col("per_minute") >= c.min_replays_per_minute)
                    # Re-evaluated GPUs replace their previous verdict; others keep theirs.
                    kept = self._flagged.join(due.select("node", "gpu"), on=["node", "gpu"], how="anti") if self._flagged is not None else None
                    self._flagged = hot if kept is None else pl.concat([kept, hot], how="vertical_relaxed")
                    self._base = pl.concat([self._base.join(due.select("node", "gpu"), on=["node", "gpu"], how="anti"), due.select("node", "gpu", "ts", "count")])
        if self._flagged is None or self._flagged.height == 0:
            return []
        findings = []
        for row in self._flagged.join(gpu_jobs(window), on=["node", "gpu"], how="left").iter_rows(named=True):
            findings.append(
                Finding(
                    kind=FindingKind.PCIE_REPLAY,
                    severity=Severity.TICKET,
                    ts=window.now,
                    job=row["job"],
                    ranks=[int(row["rank"])] if row["rank"] is not None else [],
                    node=row["node"],
                    gpu=row["gpu"],
                    cause="hardware",
                    source=self.name,
                    evidence={
                        "pcie_replays_per_minute": round(float(row["per_minute"]), 1),
                        "pcie_replay_total": int(row["count"]),
                        "window_seconds": round(float(row["ts"] - row["ts0"]), 1),
                    },
                    summary=(
                        f"{row['node']} GPU {row['gpu']} PCIe link replays {row['per_minute']:.0f} packets/min ({int(row['count'])} so far): "
                        "the link is degrading; schedule the node for maintenance before the GPU falls off the bus."
                    ),
                )
            )
        return findings


class JoinEcc:
    name = "ecc"

    def __init__(self, cfg: dict[str, Any] | None = None):
        self.config = settings("ecc", EccConfig, cfg)
        self._counters: pl.DataFrame | None = None
        self._last_now: float | None = None

    def detect(self, window: Window) -> list[Finding]:
        now = window.now
        # Each incident is reported once, on the tick it arrives (on the first tick: the recent
        # past); the pipeline keeps the finding active for `clear_after_seconds.ecc`.
        since = now - self.config.report_seconds if self._last_now is None else self._last_now
        self._last_now = now
        ev = (
            window.get("events")
            .filter(
                (pl.col("ts") > since)
                & (pl.col("kind").is_in(["ecc_dbe", "ecc"]) | ((pl.col("kind") == "xid") & pl.col("xid").is_in(self.config.ecc_codes)))
            )
            .group_by(["node", "gpu"])
            .agg(pl.len().alias("events"), pl.col("xid").drop_nulls().unique().sort().alias("xids"), pl.col("ts").max().alias("event_ts"), pl.col("job").drop_nulls().last().alias("event_job"))
        )
        # Counters: compare this tick's readings with the previous ones. Only GPUs that ever had
        # a DBE or a remap failure are kept: O(GPUs) filter per tick, tiny state.
        gs = (
            window.fresh("gpu_samples")
            .filter((pl.col("ecc_dbe_volatile_total") > 0) | pl.col("remap_failure").fill_null(False))
            .select("node", "gpu", "ecc_dbe_volatile_total", "retired_pages_total", "remap_failure")
        )
        # Several samples of one GPU in a tick are one reading: its highest counters (they only
        # grow) and any remap failure. Row by row, each sample was compared with the other's
        # previous value and one DBE paged on every tick (fixed in ecc.py since; this
        # reference follows, so the test still compares the fast code with the plain one).
        gs = gs.group_by("node", "gpu", maintain_order=True).agg(
            pl.col("ecc_dbe_volatile_total").max(), pl.col("retired_pages_total").max(), pl.col("remap_failure").any()
        )
        if ev.height == 0 and gs.height == 0:
            return []
        prev = self._counters
        self._counters = gs if prev is None else pl.concat([prev.join(gs.select("node", "gpu"), on=["node", "gpu"], how="anti"), gs])
        if prev is None:
            prev = gs.clear()
        counters = (
            gs.join(prev.select("node", "gpu", pl.col("ecc_dbe_volatile_total").alias("_dbe0")), on=["node", "gpu"], how="left")
            .select(
                "node",
                "gpu",
                # A counter lower than before was reset (GPU reset): all of it is new.
                pl.when(pl.col("ecc_dbe_volatile_total") < pl.col("_dbe0").fill_null(0))
                .then(pl.col("ecc_dbe_volatile_total"))
                .otherwise(pl.col("ecc_dbe_volatile_total") - pl.col("_dbe0").fill_null(0))
                .alias("dbe_delta"),
                pl.col("ecc_dbe_volatile_total").alias("dbe_total"),
                pl.col("retired_pages_total").alias("remapped"),
                pl.col("remap_failure").fill_null(False),
            )
            .filter((pl.col("dbe_delta") > 0) | pl.col("remap_failure"))
        )
        hits = ev.join(counters, on=["node", "gpu"], how="full", coalesce=True).join(gpu_jobs(window), on=["node", "gpu"], how="left")
        findings = []
        for row in hits.iter_rows(named=True):
            xids = row["xids"] or []
            job = row["job"] or row["event_job"]
            actions = sorted({xid_table.xid_info(x).action for x in xids if xid_table.xid_info(x)})
            uncorrectable = bool(row["dbe_delta"] or 0) or bool(set(xids) & {48, 63, 94, 95})
            remap_failed = bool(row["remap_failure"]) or 64 in xids
            findings.append(
                Finding(
                    kind=FindingKind.ROW_REMAP_FAILURE if remap_failed else FindingKind.ECC,
                    severity=Severity.PAGE,
                    ts=float(row["event_ts"] or now),
                    job=job,
                    node=row["node"],
                    gpu=row["gpu"],
                    xid=xids[0] if xids else None,
                    cause="hardware",
                    source=self.name,
                    evidence={
                        "xids": xids,
                        "dbe_new": int(row["dbe_delta"] or 0),
                        "dbe_volatile_total": int(row["dbe_total"] or 0),
                        "remapped_rows": int(row["remapped"] or 0),
                        "remap_failure": bool(row["remap_failure"]),
                        "nvidia_action": ",".join(actions) or "DRAIN_AND_RESET",
                    },
                    summary=(
                        (
                            f"Row remapping failed on {row['node']} GPU {row['gpu']}" + (" after an uncorrectable ECC error" if uncorrectable else "")
                            if remap_failed
                            else f"Uncorrectable ECC error on {row['node']} GPU {row['gpu']}"
                        )
                        + (f" (XID {', '.join(map(str, xids))})" if xids else "")
                        + (f", under job {job}" if job else "")
                        + (
                            ": the GPU can no longer repair its failing memory (NVIDIA's RMA criterion): drain the node and replace the GPU."
                            if remap_failed
                            else ": drain the node and reset the GPU before it runs anything again."
                        )
                    ),
                )
            )
        return findings


class JoinHangDevice:
    name = "hang_device"
    level = "L0"
    capability = "hang"
    streams = ("gpu_samples", "allocations")

    def __init__(self, cfg: dict[str, Any] | None = None):
        self.config = settings("hang_device", HangDeviceConfig, cfg)
        self._base = pl.DataFrame(schema={"node": pl.Utf8, "gpu": pl.Int32, "bp": pl.Float64, "bl": pl.Float64, "bn": pl.Int64})
        self._since: dict[str, float] = {}  # job → candidate since
        self._last_cand: dict[str, float] = {}
        self._recovered: dict[str, float] = {}  # job → longest waiting phase that ended by itself

    def _update_baseline(self, fresh: pl.DataFrame) -> pl.DataFrame:
        """Per GPU: EWMA of power and link bytes over busy samples (util high and power not collapsed)."""
        c = self.config
        link = _nz("nvlink_tx_bytes_per_second") + _nz("nvlink_rx_bytes_per_second") + _nz("pcie_tx_bytes_per_second") + _nz("pcie_rx_bytes_per_second")
        cur = fresh.select("node", "gpu", "util_ratio", "power_w", link.alias("link"))
        joined = cur.join(self._base, on=["node", "gpu"], how="left")
        busy = (pl.col("util_ratio") >= 0.5) & (pl.col("bp").is_null() | (pl.col("power_w") > c.quiet_power_ratio * pl.col("bp")))
        a = c.baseline_alpha
        upd = joined.filter(busy & pl.col("power_w").is_not_null()).select(
            "node",
            "gpu",
            pl.when(pl.col("bp").is_null()).then(pl.col("power_w")).otherwise((1 - a) * pl.col("bp") + a * pl.col("power_w")).alias("bp"),
            pl.when(pl.col("bl").is_null()).then(pl.col("link")).otherwise((1 - a) * pl.col("bl") + a * pl.col("link")).alias("bl"),
            (pl.col("bn").fill_null(0) + 1).alias("bn"),
        )
        self._base = pl.concat([self._base.join(upd.select("node", "gpu"), on=["node", "gpu"], how="anti"), upd], how="vertical_relaxed")
        return self._base

    def detect(self, window: Window) -> list[Finding]:
        c = self.config
        now = window.now
        fresh = window.fresh("gpu_samples")
        alloc = window.get("allocations")
        if fresh.height == 0 or alloc.height == 0:
            return []
        # (a stable sort: of a GPU's same-time samples the later row is the latest, as the fast code takes it)
        fresh = fresh.sort("ts", maintain_order=True).group_by(["node", "gpu"], maintain_order=True).last()
        base = self._update_baseline(fresh)
        g = alloc.select("job", "rank", "node", "gpu").join(fresh, on=["node", "gpu"], how="left").join(base, on=["node", "gpu"], how="left")
        link = _nz("nvlink_tx_bytes_per_second") + _nz("nvlink_rx_bytes_per_second") + _nz("pcie_tx_bytes_per_second") + _nz("pcie_rx_bytes_per_second")
        has_link = pl.any_horizontal([pl.col(x).is_not_null() for x in ("nvlink_tx_bytes_per_second", "pcie_tx_bytes_per_second")])
        quiet = (
            (pl.col("bn") >= c.min_baseline_samples)
            & (pl.col("power_w") <= c.quiet_power_ratio * pl.col("bp"))
            & (pl.col("sm_active_ratio").is_null() | (pl.col("sm_active_ratio") <= c.quiet_sm_active))
            & (pl.col("tensor_active_ratio").is_null() | (pl.col("tensor_active_ratio") <= c.quiet_tensor_active))
            & (~has_link | (pl.col("bl") <= 0) | (link <= c.quiet_link_ratio * pl.col("bl")))
        )
        g = g.with_columns(
            pl.col("util_ratio").is_null().alias("silent"),
            ((pl.col("util_ratio") >= c.util_pinned) & quiet).fill_null(False).alias("waiting"),
            (pl.col("util_ratio") <= c.util_absent).fill_null(False).alias("absent"),
        )
        per_job = g.group_by("job").agg(
            pl.len().alias("n"),
            pl.col("waiting").sum().alias("n_wait"),
            pl.col("absent").sum().alias("n_absent"),
            pl.col("silent").sum().alias("n_silent"),
        )
        cand = per_job.filter(
            (pl.col("n") >= c.min_gpus)
            & (pl.col("n_wait") >= (pl.col("n") * c.min_waiting_share).ceil())
            & (pl.col("n_wait") + pl.col("n_absent") + pl.col("n_silent") == pl.col("n"))
        )
        cand_jobs = set(cand["job"].to_list())
        for job in list(self._since):
            if job not in cand_jobs and now - self._last_cand.get(job, now) > c.gap_tolerance_seconds:
                # The waiting phase ended by itself: remember how long such phases last.
                run = self._last_cand.get(job, now) - self._since.pop(job)
                self._recovered[job] = max(self._recovered.get(job, 0.0), run)
        if not cand_jobs:
            return []
        events = window.get("events").filter(pl.col("kind").is_in(["xid", "ecc_dbe"]) & (pl.col("ts") >= now - c.hardware_lookback_seconds))
        findings = []
        for rows in g.filter(pl.col("job").is_in(list(cand_jobs))).partition_by("job"):
            job = rows["job"][0]
            since = self._since.setdefault(job, now)
            self._last_cand[job] = now
            hold = min(c.max_hold_seconds, max(c.hold_seconds, c.recovered_factor * self._recovered.get(job, 0.0)))
            stalled = now - since
            if stalled < hold:
                continue
            waiting = rows.filter(pl.col("waiting"))
            odd = rows.filter(~pl.col("waiting")).sort("rank")
            culprit_ranks = odd["rank"].to_list()
            # A rank not placed on a node yet (a pending pod) has no node whose hardware to blame.
            nodes = sorted({n for n in odd["node"].to_list() if n is not None})
            hw = events.filter(pl.col("node").is_in(nodes)) if nodes else events.clear()
            # No telemetry from a GPU it was placed on: the GPU is gone (hardware). A rank placed on
            # no GPU yet never started: the job waits for it, which requeueing fixes (software).
            unplaced = odd.filter(pl.col("node").is_null() | pl.col("gpu").is_null())["rank"].to_list()
            silent = odd.filter(pl.col("silent") & pl.col("node").is_not_null() & pl.col("gpu").is_not_null())["rank"].to_list()
            cause = "hardware" if (silent or hw.height) else ("software" if culprit_ranks else None)
            first = odd.row(0, named=True) if odd.height else None
            where = ", ".join(rank_at(r["rank"], r["node"], r["gpu"]) for r in odd.head(4).iter_rows(named=True))
            if culprit_ranks:
                why = "no telemetry: the GPU is gone" if silent else ("not placed on a GPU: its rank never started" if unplaced else "util 0: its rank never entered the collective")
                head = f"{where}{' and more' if odd.height > 4 else ''} differ(s) ({why})"
            else:
                head = "every GPU waits alike: the culprit is inside a device kernel or the network (L0 cannot name it; L1 Flight Recorder can)"
            wp = waiting["power_w"].median()
            bp = waiting["bp"].median()
            findings.append(
                Finding(
                    kind=FindingKind.COLLECTIVE_HANG,
                    severity=Severity.PAGE,
                    ts=now,
                    job=job,
                    ranks=culprit_ranks,
                    culprit_ranks=culprit_ranks,
                    node=first["node"] if first else None,
                    gpu=first["gpu"] if first and odd.height == 1 else None,
                    cause=cause,
                    source=self.name,
                    evidence={
                        "level": "L0",
                        "stalled_seconds": round(stalled, 1),
                        "hold_seconds": round(hold, 1),
                        "waiting_gpus": int(waiting.height),
                        "gpus": int(rows.height),
                        "culprit_gpus": [f"{r['node']}:{r['gpu']}" for r in odd.head(16).iter_rows(named=True)],
                        "silent_ranks": silent,
                        "waiting_util_median": _r(waiting["util_ratio"].median()),
                        "waiting_power_w_median": _r(wp),
                        "busy_power_w_median": _r(bp),
                        "waiting_sm_active_median": _r(waiting["sm_active_ratio"].median()),
                        "xids": sorted({int(x) for x in hw["xid"].drop_nulls().to_list()}),
                    },
                    summary=(
                        f"{job} looks hung from its GPUs (L0): {waiting.height} of {rows.height} GPUs spin at "
                        f"{100 * (waiting['util_ratio'].median() or 0):.0f}% util on {_r(wp)} W (busy: {_r(bp)} W) for {stalled:.0f} s; {head}."
                    ),
                )
            )
        return findings
