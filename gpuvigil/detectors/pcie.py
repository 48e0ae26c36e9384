"""PCIe replay growth: a GPU whose link keeps retransmitting packets is failing.

NVML's PCIe replay counter is cumulative and a few replays over a GPU's life are normal; a
sustained rate is not (a degrading riser, connector or retimer, often followed by XID 79). The
rate is measured per GPU over `window_seconds` from this tick's counters against a per-GPU
baseline (O(GPUs) per tick). It is reported as kind `pcie_replay` (a device's own fault: the
hardware team's, whichever job holds the GPU) at severity ticket, with a cordon hint: worth a
maintenance slot, not a page.

A growing replay counter is tested on simulated data only: the real H200 capture's counter is 0
and never moves (there it is a hard negative; docs/testing.md).
"""

from __future__ import annotations

from typing import Any

import polars as pl
from pydantic import BaseModel

from gpuvigil.detectors.base import HISTORY, Declared, DetectorSpec, Reads
from gpuvigil.detectors.common import counter_rate_findings, settings
from gpuvigil.detectors.per_gpu import CounterRate
from gpuvigil.model import Finding, FindingKind
from gpuvigil.window import Window


class PcieConfig(BaseModel):
    window_seconds: float = 60.0
    min_replays_per_minute: float = 100.0


class PcieReplayDetector(Declared):
    spec = DetectorSpec(
        name="pcie",
        config=PcieConfig,
        emits=(FindingKind.PCIE_REPLAY,),
        reads={"gpu_samples": Reads(history=False, columns=("ts", "node", "gpu", "pcie_replay_total")), "allocations": HISTORY},
        order=120,
        level="L0",
        streams=("gpu_samples",),
    )

    def __init__(self, cfg: dict[str, Any] | None = None):
        self.config = settings("pcie", PcieConfig, cfg)
        self._counter = CounterRate()  # per GPU, in numpy slots (detectors/per_gpu.py)

    @property
    def _base(self) -> pl.DataFrame:
        return self._counter._base

    def detect(self, window: Window) -> list[Finding]:
        c = self.config
        self._counter.fold(window.fresh("gpu_samples"), "pcie_replay_total", c.window_seconds, c.min_replays_per_minute)
        flagged = self._counter.flagged()
        if flagged.height == 0:
            return []
        return counter_rate_findings(
            flagged, window, kind=FindingKind.PCIE_REPLAY, source=self.name, rate_key="pcie_replays_per_minute", total_key="pcie_replay_total",
            say=lambda row: (
                f"{row['node']} GPU {row['gpu']} PCIe link replays {row['per_minute']:.0f} packets/min ({int(row['count'])} so far): "
                "the link is degrading; schedule the node for maintenance before the GPU falls off the bus."
            ),
        )
