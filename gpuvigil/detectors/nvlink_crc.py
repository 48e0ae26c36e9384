"""NVLink CRC errors: a GPU whose NVLinks keep failing their CRC checks has a degrading link.

DCGM's `DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL` and `..._CRC_DATA_ERROR_COUNT_TOTAL`
(NVML's per-link DL CRC counters) are cumulative; a few over a GPU's life are normal, a sustained
rate is a failing cable, connector or NVSwitch port, which slows every collective through it (the
link retrains and replays) before it goes down. The rate is measured per GPU over
`window_seconds` (detectors/per_gpu.py: CounterRate) and reported as kind `nvlink_crc`, a ticket
for the hardware team with a cordon hint.

dcgm-exporter exports the CRC counters once they are added to its counters file; without them
the column is null and the detector stays silent. Tested on simulated counters only.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from gpuvigil.detectors.base import HISTORY, Declared, DetectorSpec, Reads
from gpuvigil.detectors.common import counter_rate_findings, settings
from gpuvigil.detectors.per_gpu import CounterRate
from gpuvigil.model import Finding, FindingKind, place
from gpuvigil.window import Window


class NvlinkCrcConfig(BaseModel):
    window_seconds: float = Field(60.0, gt=0)
    min_errors_per_minute: float = Field(10.0, gt=0)


class NvlinkCrcDetector(Declared):
    spec = DetectorSpec(
        name="nvlink_crc",
        config=NvlinkCrcConfig,
        emits=(FindingKind.NVLINK_CRC,),
        reads={"gpu_samples": Reads(history=False, columns=("ts", "node", "gpu", "nvlink_crc_errors_total")), "allocations": HISTORY},
        order=125,
    )

    def __init__(self, cfg: dict[str, Any] | None = None):
        self.config = settings(self.spec.name, NvlinkCrcConfig, cfg)
        self._counter = CounterRate()

    def detect(self, window: Window) -> list[Finding]:
        c = self.config
        self._counter.fold(window.fresh("gpu_samples"), "nvlink_crc_errors_total", c.window_seconds, c.min_errors_per_minute)
        flagged = self._counter.flagged()
        if flagged.height == 0:
            return []
        return counter_rate_findings(
            flagged, window, kind=FindingKind.NVLINK_CRC, source=self.name, rate_key="nvlink_crc_errors_per_minute", total_key="nvlink_crc_errors_total",
            say=lambda row: (
                f"{place(row['node'], row['gpu'])} NVLink CRC errors {row['per_minute']:.0f}/min ({int(row['count'])} so far): "
                "a link is degrading; schedule the node for maintenance before the link goes down."
            ),
        )


__all__ = ["NvlinkCrcConfig", "NvlinkCrcDetector"]
