"""The default detector set, built from config, with each detector's observation level.

Every detector declares the `level` it needs (L0 device/logs/scheduler, L1 Flight Recorder and
NCCL Inspector switches, L2 the in-process hook), the `streams` it reads, and for the headline
capabilities a `capability`: per job the pipeline keeps the best one its streams allow
(`gpuvigil.detectors.levels`).
"""

from __future__ import annotations

from typing import Any

from gpuvigil.detectors.anomaly import AnomalyDetector
from gpuvigil.detectors.base import Detector
from gpuvigil.detectors.ecc import EccDetector
from gpuvigil.detectors.fragmentation_allocator import AllocatorFragmentationDetector
from gpuvigil.detectors.fragmentation_cluster import ClusterFragmentationDetector
from gpuvigil.detectors.hang import HangDetector
from gpuvigil.detectors.hang_device import DeviceHangDetector
from gpuvigil.detectors.hang_fr import FlightRecorderHangDetector
from gpuvigil.detectors.oom import OomPredictor
from gpuvigil.detectors.oom_device import DeviceOomPredictor
from gpuvigil.detectors.oom_events import OomEventClassifier
from gpuvigil.detectors.pcie import PcieReplayDetector
from gpuvigil.detectors.straggler import StragglerDetector
from gpuvigil.detectors.straggler_device import DeviceStragglerDetector
from gpuvigil.detectors.straggler_inspector import InspectorStragglerDetector
from gpuvigil.detectors.thermal import ThermalDetector
from gpuvigil.detectors.watchdog import NcclErrorDetector, WatchdogTimeoutDetector
from gpuvigil.detectors.xid import XidDetector

# name → (level, capability, streams) for detectors whose modules predate levels.
DECLARED: dict[str, tuple[str, str | None, tuple[str, ...]]] = {
    "hang": ("L2", "hang", ("rank_progress",)),
    "oom": ("L2", "oom", ("allocator_stats",)),
    # Hook rows with a collective wait (levels.DERIVED): a hook that sends none leaves the
    # job's stragglers to the L1/L0 detectors.
    "straggler": ("L2", "straggler", ("rank_wait",)),
    "fragmentation_allocator": ("L2", None, ("allocator_stats",)),
    "oom_events": ("L0", None, ("events",)),
    "xid": ("L0", None, ("events", "gpu_samples")),
    "ecc": ("L0", None, ("events", "gpu_samples")),
    "thermal": ("L0", None, ("gpu_samples",)),
    "pcie": ("L0", None, ("gpu_samples",)),
    "fragmentation_cluster": ("L0", None, ("jobs", "nodes", "allocations")),
    "anomaly": ("L0", None, ("gpu_samples",)),
}

# Detectors that read only each tick's fresh rows of these streams (`window.fresh`), never their
# history: look-back 0, so they neither lengthen the streams' horizons nor keep their columns
# (pipeline/core.py: declared_horizons, declared_columns).
FRESH_ONLY: dict[str, tuple[str, ...]] = {
    "hang": ("rank_progress",),
    "xid": ("gpu_samples",),
    "ecc": ("gpu_samples",),
    "thermal": ("gpu_samples",),
    "pcie": ("gpu_samples",),
    "anomaly": ("gpu_samples",),
    "hang_device": ("gpu_samples",),
}


def _declare(d: Any) -> Any:
    level, capability, streams = DECLARED.get(d.name, (getattr(d, "level", "L0"), getattr(d, "capability", None), getattr(d, "streams", ())))
    for attr, value in (("level", level), ("capability", capability), ("streams", streams)):
        if not hasattr(d, attr):
            setattr(d, attr, value)
    fresh = FRESH_ONLY.get(d.name)
    if fresh and not hasattr(d, "lookback_seconds"):
        d.lookback_seconds = lambda fresh=fresh: dict.fromkeys(fresh, 0.0)
    return d


def default_detectors(cfg: dict[str, Any] | None = None) -> list[Detector]:
    return [
        _declare(d)
        for d in (
            HangDetector(cfg),
            FlightRecorderHangDetector(cfg),
            DeviceHangDetector(cfg),
            OomPredictor(cfg),
            DeviceOomPredictor(cfg),
            OomEventClassifier(cfg),
            AllocatorFragmentationDetector(cfg),
            XidDetector(cfg),
            WatchdogTimeoutDetector(cfg),
            NcclErrorDetector(cfg),
            EccDetector(cfg),
            ThermalDetector(cfg),
            PcieReplayDetector(cfg),
            StragglerDetector(cfg),
            InspectorStragglerDetector(cfg),
            DeviceStragglerDetector(cfg),
            ClusterFragmentationDetector(cfg),
            AnomalyDetector(cfg),
        )
    ]
