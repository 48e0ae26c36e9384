"""NVLink links down and the NVLink fabric (Fabric Manager / IMEX) not up, per GPU.

Reads each tick's fresh `gpu_samples` (NVML: `nvlink_links_total`, `nvlink_links_up` and
`fabric_manager_status`; dcgm-exporter: the fabric status only, DCGM has no per-link state among
its exported fields) and keeps a few numbers per GPU:

- `nvlink_down` (page): fewer links up than the GPU had up before, or than most GPUs of its node
  with as many links have up. A GPU with no NVLink (`nvlink_links_total` 0: a PCIe GPU, which NVML
  answers NotSupported for every link) is never said to have its NVLink down, nor is a GPU whose
  links were never up while its peers' are not either (an NVLink bridge that is not fitted). The
  other side of that rule: a link down on every GPU alike since before gpuvigil started (one
  NVSwitch of an HGX board) has nothing to be compared with; the same loss seen happening is
  reported on each GPU.
- `fabric_manager` (page): the GPU's fabric failed (status 4: Fabric Manager or IMEX could not
  set it up), or stays in progress (2) longer than `settle_seconds`; CUDA cannot start on it until
  it completes. "Not started" (1) is reported only with `require_fabric: true`: on single-node
  systems IMEX never starts, and GB200/GB300 trays report it where no Fabric Manager is needed.
"""

from __future__ import annotations

from typing import Any

import polars as pl
from pydantic import BaseModel, Field

from gpuvigil.detectors.base import FRESH, HISTORY, Declared, DetectorSpec
from gpuvigil.detectors.common import gpu_jobs, settings
from gpuvigil.model import Finding, FindingKind, Severity, place
from gpuvigil.window import Window

FABRIC_NAMES = {0: "not supported", 1: "not started", 2: "in progress", 3: "success", 4: "failure", 5: "unrecognized", 6: "NVML too old"}


class NvlinkFabricConfig(BaseModel):
    settle_seconds: float = Field(300.0, ge=0)
    require_fabric: bool = False
    min_peers: int = Field(2, ge=1)


class NvlinkFabricDetector(Declared):
    spec = DetectorSpec(
        name="nvlink_fabric",
        config=NvlinkFabricConfig,
        emits=(FindingKind.NVLINK_DOWN, FindingKind.FABRIC_MANAGER),
        reads={"gpu_samples": FRESH, "allocations": HISTORY},
        order=126,
        level="L0",
        streams=("gpu_samples",),
    )

    def __init__(self, cfg: dict[str, Any] | None = None):
        self.config = settings("nvlink_fabric", NvlinkFabricConfig, cfg)
        self._max_up: dict[tuple[str, int], int] = {}  # the most links each GPU had up
        self._waiting_since: dict[tuple[str, int], tuple[int, float]] = {}  # GPU -> (status, since)

    def detect(self, window: Window) -> list[Finding]:
        fresh = window.fresh("gpu_samples")
        if fresh.height == 0:
            return []
        cols = ("nvlink_links_total", "nvlink_links_up", "fabric_manager_status")
        if all(fresh.get_column(c).null_count() == fresh.height for c in cols):
            return []  # no source of this tick reads them (dcgm-exporter's default fields)
        now = window.now
        c = self.config
        latest = (
            fresh.select("ts", "node", "gpu", *cols)
            .filter(pl.col("node").is_not_null() & pl.col("gpu").is_not_null())
            .sort("ts")
            .group_by("node", "gpu", maintain_order=True)
            .agg(pl.col("ts").last(), *[pl.col(k).drop_nulls().last() for k in cols])
        )
        findings: list[Finding] = []
        jobs = gpu_jobs(window)
        rows = latest.join(jobs, on=["node", "gpu"], how="left").rows(named=True) if latest.height else []

        # -- NVLink ----------------------------------------------------------------------
        linked = [r for r in rows if (r["nvlink_links_total"] or 0) > 0 and r["nvlink_links_up"] is not None]
        peers: dict[tuple[str, int], list[int]] = {}
        for r in linked:
            peers.setdefault((r["node"], r["nvlink_links_total"]), []).append(r["nvlink_links_up"])
        for r in linked:
            key = (r["node"], r["gpu"])
            up, total = r["nvlink_links_up"], r["nvlink_links_total"]
            before = self._max_up.get(key, 0)
            self._max_up[key] = max(before, up)
            ups = peers[(r["node"], total)]
            majority = next((v for v in set(ups) if ups.count(v) * 2 > len(ups) and ups.count(v) >= c.min_peers), None)
            expected = max(before, majority or 0)
            if up >= expected:
                continue
            source = "it had" if before >= (majority or 0) else "its node's other GPUs have"
            findings.append(
                Finding(
                    kind=FindingKind.NVLINK_DOWN, severity=Severity.PAGE, ts=now, job=r["job"], ranks=[int(r["rank"])] if r["rank"] is not None else [],
                    node=r["node"], gpu=r["gpu"], cause="hardware", source=self.name,
                    evidence={"nvlink_links_up": up, "nvlink_links_total": total, "expected_up": expected, "expected_from": "itself" if source == "it had" else "peers"},
                    summary=(f"NVLink down on {place(r['node'], r['gpu'])}: {up} of {total} links up where {expected} should be ({source})"
                             + (f", under job {r['job']}" if r["job"] else "")
                             + ": collectives across the node's GPUs slow down or fail; cordon the node and reset the GPU (NVIDIA: XID 74 follows)."),
                )
            )

        # -- the fabric --------------------------------------------------------------------
        watched = {2, 4} | ({1} if c.require_fabric else set())
        for r in rows:
            key = (r["node"], r["gpu"])
            status = r["fabric_manager_status"]
            if status is None or status not in watched:
                self._waiting_since.pop(key, None)
                continue
            if (r["nvlink_links_total"] is not None and r["nvlink_links_total"] == 0) and status != 4:
                continue  # no NVLink: nothing for a fabric to set up
            held, since = self._waiting_since.get(key, (status, now))
            if held != status:
                since = now
            self._waiting_since[key] = (status, since)
            waited = now - since
            if status != 4 and waited < c.settle_seconds:
                continue
            name = FABRIC_NAMES.get(int(status), str(status))
            findings.append(
                Finding(
                    kind=FindingKind.FABRIC_MANAGER, severity=Severity.PAGE, ts=now, job=r["job"], ranks=[int(r["rank"])] if r["rank"] is not None else [],
                    node=r["node"], gpu=r["gpu"], cause="hardware", source=self.name,
                    evidence={"fabric_manager_status": int(status), "status": name, "seconds_in_state": round(waited, 1)},
                    summary=(f"NVLink fabric {name} on {place(r['node'], r['gpu'])}"
                             + (f" for {waited:.0f} s" if status != 4 else "")
                             + ": CUDA cannot use the GPU until Fabric Manager (or IMEX, multi-node NVLink) sets it up; "
                             "check nvidia-fabricmanager / nvidia-imex on the node, then drain and reboot it if it does not recover."),
                )
            )
        return findings


__all__ = ["FABRIC_NAMES", "NvlinkFabricConfig", "NvlinkFabricDetector"]
