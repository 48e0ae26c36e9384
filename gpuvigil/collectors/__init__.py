"""Collectors: NVML, DCGM, kernel XIDs, PyTorch/NCCL logs, Flight Recorder, the in-process hook,
scheduler state, and the simulated cluster. Each emits polars frames of a declared schema."""

from gpuvigil.collectors.base import Collector

__all__ = ["Collector"]
