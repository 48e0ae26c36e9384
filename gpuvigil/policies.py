"""Policies every mode shares: how grave an XID is, which events implicate a node's hardware, and
which finding a GPU's failing memory is.

`serve`'s detectors, the kernel-log and DCGM collectors, and `analyze` of a log file all ask here,
so that an XID is the same severity online and offline, and an application's XID (the XID
table's `app_level`: a bug in the job, not a fault in the GPU) never makes a hang or a timeout a
hardware one (which cordons the node).
"""

from __future__ import annotations

import polars as pl

from gpuvigil.gpu import xid as xid_table
from gpuvigil.model import FindingKind, Severity

# Event kinds that say something about the device's hardware: XIDs, uncorrectable ECC errors
# (NVML's `ecc_dbe` events) and ECC findings turned events.
HARDWARE_EVENT_KINDS = ("xid", "ecc_dbe", "ecc")


def xid_severity(code: int, message: str = "") -> Severity:
    """Page for an XID that needs an operator (reset, reboot, drain); info for one NVIDIA says to
    ignore (action IGNORE: XID 43's channel reset after an application fault, 63's row remap);
    else a ticket."""
    if xid_table.is_fatal(code, message):
        return Severity.PAGE
    info = xid_table.xid_info(code)
    if info is not None and info.action == "IGNORE":
        return Severity.INFO
    return Severity.TICKET


def xid_cause(code: int, message: str = "") -> str | None:
    """'hardware' for an XID that needs an operator, 'software' for an application's own XID,
    None when the table does not say (an unknown code, a firmware warning)."""
    if xid_table.is_fatal(code, message):
        return "hardware"
    info = xid_table.xid_info(code)
    return "software" if info is not None and info.app_level else None


def app_level_xids() -> list[int]:
    return sorted(code for code, info in xid_table.table().items() if info.app_level)


def implicates_hardware(since: float) -> pl.Expr:
    """Events (rows of the `events` stream) since `since` that implicate a node's hardware: an
    XID that is not the application's own, an uncorrectable ECC error. A hang or timeout with one
    on a culprit's node is a hardware one (cordon the node); an application XID (13, 31, 43, 45)
    on it is the job's bug and implicates nothing."""
    app = pl.col("xid").is_in(app_level_xids()).fill_null(False)
    return pl.col("kind").is_in(HARDWARE_EVENT_KINDS) & ~((pl.col("kind") == "xid") & app) & (pl.col("ts") >= since)


# What to do about failing memory, by the finding it is.
MEMORY_REMEDY = {
    FindingKind.ROW_REMAP_FAILURE: "the GPU can no longer repair its failing memory (NVIDIA's RMA criterion): drain the node and replace the GPU",
    FindingKind.ECC: "drain the node and reset the GPU before it runs anything again",
}


def memory_fault(remap_failed: bool, uncorrectable: bool) -> FindingKind | None:
    """The finding a GPU's memory state is, whoever read it (NVML, DCGM, an XID, `nvidia-smi -q`):
    a failed row remap is `row_remap_failure` (the GPU goes to RMA; an uncorrectable error with it
    is its evidence), else an uncorrectable error is `ecc` (drain and reset), else none."""
    if remap_failed:
        return FindingKind.ROW_REMAP_FAILURE
    return FindingKind.ECC if uncorrectable else None
