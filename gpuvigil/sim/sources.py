"""When the simulated cluster's device telemetry reaches a collector: each node's exporter on its
own sample clock, with lost, late and drifting samples.

dcgm-exporter refreshes its fields every 30 s by default (`-c 30000`) and Prometheus scrapes it
every 15-60 s; NVML is polled at about 1 s. The exporters of different nodes are not in step, a
scrape fails now and then (a node under load, a network blip) and a sample can arrive after
newer ones from other nodes (a slow remote write, a collector that catches up). This module
thins the world's per-tick frames to what such sources deliver. It draws from its own random
stream, so the world (faults, jobs, readings) is the same at every sample rate: a benchmark
compares sample rates on identical runs.

A source samples the world as it is on the tick at or after its due time; at a tick coarser
than the sample interval a node yields one sample per tick (the world has no state in between).

Two ways such samples reach the pipeline (`mode`):
- `scraped`: the pipeline scrapes the exporter on every tick (gpuvigil.collectors.dcgm), and the
  exporter answers with the values of its last refresh, stamped with the scrape's time: the same
  readings for up to an interval, then a jump. A lost refresh keeps the old values one interval
  more; a late one keeps them until it lands.
- `history`: Prometheus history (`gpuvigil replay`): one row per node per interval, with the time
  it was taken; a lost sample is a gap, a late one arrives after newer rows of other nodes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import polars as pl

# The streams a device exporter delivers (per-GPU readings and NVML's per-process memory).
DEVICE_STREAMS = ("gpu_samples", "gpu_processes")


class DeviceSampler:
    """Per-node sample clocks over the device streams.

    `interval`: seconds between a node's samples (None: every tick). `drop_share`: share of a
    node's samples never delivered. `late_share`, `late_seconds`: share delivered late, and by how
    much (uniform). `jitter`: the interval between a node's samples varies by ±jitter s."""

    def __init__(
        self,
        nodes: Sequence[str],
        interval: float | None = None,
        *,
        drop_share: float = 0.0,
        late_share: float = 0.0,
        late_seconds: tuple[float, float] = (5.0, 60.0),
        jitter: float = 0.0,
        seed: int = 0,
        streams: Sequence[str] = DEVICE_STREAMS,
        mode: str = "scraped",
    ):
        if mode not in ("scraped", "history"):
            raise ValueError(f"unknown device sample mode {mode!r}")
        self.mode = mode
        self._cache: dict[str, pl.DataFrame] = {}  # scraped: stream -> the rows of each node's last refresh
        self._refresh_late: list[tuple[float, str, dict[str, pl.DataFrame]]] = []  # scraped: (lands at, node, rows)
        self.nodes = list(nodes)
        self.interval = interval
        self.drop_share = drop_share
        self.late_share = late_share
        self.late_seconds = late_seconds
        self.jitter = jitter
        self.streams = tuple(streams)
        self.rng = np.random.default_rng([seed, 0x53414D50])
        n = len(self.nodes)
        # Each node's exporter started at its own moment: its first sample is somewhere in the
        # first interval.
        self.next_due = self.rng.uniform(0.0, interval, n) if interval else np.zeros(n)
        self._held: list[tuple[float, str, pl.DataFrame]] = []
        self.delivered = 0  # node samples delivered on time or late
        self.dropped = 0
        self.late = 0

    @property
    def passthrough(self) -> bool:
        return not self.interval and not self.drop_share and not self.late_share

    def due(self, now: float) -> tuple[list[str], list[str]]:
        """(nodes delivered now, nodes whose sample taken now arrives late); advances the clocks."""
        idx = np.nonzero(self.next_due <= now + 1e-9)[0]
        if self.interval:
            step = self.interval
            nxt = self.next_due[idx]
            # A tick coarser than the interval: one sample now, the next one after this tick.
            behind = np.floor((now - nxt) / step) + 1
            nxt = nxt + behind * step
            if self.jitter:
                nxt = nxt + self.rng.uniform(-self.jitter, self.jitter, len(idx))
            self.next_due[idx] = np.maximum(nxt, now + 1e-6)
        u = self.rng.random(len(idx))
        dropped = u < self.drop_share
        late = (~dropped) & (u < self.drop_share + self.late_share)
        self.dropped += int(dropped.sum())
        self.late += int(late.sum())
        self.delivered += int((~dropped).sum())
        on_time = [self.nodes[i] for i in idx[~dropped & ~late]]
        return on_time, [self.nodes[i] for i in idx[late]]

    def deliver(self, now: float, frames: Mapping[str, pl.DataFrame]) -> dict[str, pl.DataFrame]:
        """The frames a collector receives at `now`: device rows of the nodes due (plus late ones
        released now, with the time they were taken), every other stream as it is; `scraped`:
        every node's rows of its last refresh, stamped `now`."""
        out = dict(frames)
        if self.passthrough:
            return out
        if self.mode == "scraped":
            return self._scraped(now, frames, out)
        on_time, late = self.due(now)
        if late:
            lo, hi = self.late_seconds
            delay = {node: float(self.rng.uniform(lo, hi)) for node in late}
        for stream in self.streams:
            df = frames.get(stream)
            if df is None:
                continue
            parts = [df.filter(pl.col("node").is_in(on_time))]
            for node in late:
                held = df.filter(pl.col("node") == node)
                if held.height:
                    self._held.append((now + delay[node], stream, held))
            ready = [h for h in self._held if h[1] == stream and h[0] <= now + 1e-9]
            if ready:
                parts += [h[2] for h in ready]
                self._held = [h for h in self._held if not (h[1] == stream and h[0] <= now + 1e-9)]
            out[stream] = parts[0] if len(parts) == 1 else pl.concat(parts, how="vertical_relaxed")
        return out

    def _scraped(self, now: float, frames: Mapping[str, pl.DataFrame], out: dict[str, pl.DataFrame]) -> dict[str, pl.DataFrame]:
        on_time, late = self.due(now)
        for node in late:
            self._refresh_late.append((now + float(self.rng.uniform(*self.late_seconds)), node, {s: frames[s].filter(pl.col("node") == node) for s in self.streams if s in frames}))
        ready = [h for h in self._refresh_late if h[0] <= now + 1e-9]
        self._refresh_late = [h for h in self._refresh_late if h[0] > now + 1e-9]
        refreshed = set(on_time) | {h[1] for h in ready}
        for stream in self.streams:
            df = frames.get(stream)
            if df is None:
                continue
            parts = [df.filter(pl.col("node").is_in(on_time))] + [h[2][stream] for h in ready if stream in h[2]]
            old = self._cache.get(stream)
            if old is not None:
                # A refresh replaces all of its node's rows (a process that left is gone).
                parts.insert(0, old.filter(~pl.col("node").is_in(sorted(refreshed))))
            cache = pl.concat(parts, how="vertical_relaxed")
            self._cache[stream] = cache
            out[stream] = cache.with_columns(pl.lit(now, dtype=df.schema["ts"]).alias("ts"))
        return out
