"""The default detector set, built from config."""

from __future__ import annotations

from typing import Any

from gpuvigil.detectors.anomaly import AnomalyDetector
from gpuvigil.detectors.base import Detector
from gpuvigil.detectors.ecc import EccDetector
from gpuvigil.detectors.fragmentation_allocator import AllocatorFragmentationDetector
from gpuvigil.detectors.fragmentation_cluster import ClusterFragmentationDetector
from gpuvigil.detectors.hang import HangDetector
from gpuvigil.detectors.oom import OomPredictor
from gpuvigil.detectors.oom_events import OomEventClassifier
from gpuvigil.detectors.pcie import PcieReplayDetector
from gpuvigil.detectors.straggler import StragglerDetector
from gpuvigil.detectors.thermal import ThermalDetector
from gpuvigil.detectors.xid import XidDetector


def default_detectors(cfg: dict[str, Any] | None = None) -> list[Detector]:
    return [
        HangDetector(cfg),
        OomPredictor(cfg),
        OomEventClassifier(cfg),
        AllocatorFragmentationDetector(cfg),
        XidDetector(cfg),
        EccDetector(cfg),
        ThermalDetector(cfg),
        PcieReplayDetector(cfg),
        StragglerDetector(cfg),
        ClusterFragmentationDetector(cfg),
        AnomalyDetector(cfg),
    ]
