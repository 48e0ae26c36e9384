"""Shared by the observation-level tests: play frames tick by tick through a detector or pipeline."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import polars as pl

from gpuvigil import config, schemas
from gpuvigil.pipeline.core import PipelineConfig
from gpuvigil.window import Window

H200 = Path(__file__).parent / "data" / "h200"


def window() -> Window:
    return Window(config.section("pipeline", PipelineConfig, config.defaults()).horizon_seconds)


def play_per_tick(detector, ticks: Iterable[tuple[float, dict[str, pl.DataFrame]]]) -> list[list]:
    """Feed (now, frames) in order; return each tick's findings, one list per tick."""
    w = window()
    out = []
    for now, frames in ticks:
        for stream, df in frames.items():
            w.add(stream, df)
        w.seal(now)
        out.append(detector.detect(w))
    return out


def play(detector, ticks: Iterable[tuple[float, dict[str, pl.DataFrame]]]) -> list:
    """Feed (now, frames) in order; return every finding with the tick it came on."""
    return [f for tick in play_per_tick(detector, ticks) for f in tick]


def allocations(job: str, gpus: list[tuple[str, int]]) -> pl.DataFrame:
    return schemas.frame([{"job": job, "rank": r, "node": n, "gpu": g} for r, (n, g) in enumerate(gpus)], schemas.ALLOCATIONS)


def gpu_rows(now: float, rows: list[dict]) -> pl.DataFrame:
    return schemas.frame([{"ts": now, "memory_total_bytes": 150_754_820_096, **r} for r in rows], schemas.GPU_SAMPLES)


def cfg_with(block: str, **values) -> dict:
    return config.load(overrides={"detectors": {block: values}})
