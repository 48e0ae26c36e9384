"""Join the node's own GPU → job, rank map (`gpu_jobs`) onto what the detectors read.

On a real node the built-in scheduler places nothing, so `allocations` is empty unless a
scheduler state collector runs, and many per-GPU rows arrive without a job: kernel-log XIDs,
hook records from code that did not name its job, L0 (per-GPU) signals. The latest `gpu_jobs`
snapshot fills them, per tick, before the window sees them:

- `allocator_stats`, `rank_progress`, `events`: a null `job` is taken from the GPU's job, and a
  null `rank` from the GPU's rank when the row's job is that job (or was null);
The map also takes dcgm-exporter's `hpc_job` / `pod` labels (`gpu_workloads`), so a node
monitored through DCGM alone gets the same join.

- `allocations`: the scheduler's snapshot plus a row per GPU that the scheduler did not place
  and the node attributes to a job — so `detectors.common.gpu_jobs(window)` names the job and
  rank of a GPU at every observation level.
"""

from __future__ import annotations

import polars as pl

from gpuvigil import schemas
from gpuvigil.collectors.jobmap import SOURCE_PRIORITY

FILLED_STREAMS = ("allocator_stats", "rank_progress", "events")


def per_gpu(gpu_jobs: pl.DataFrame) -> pl.DataFrame:
    """One (node, gpu) → job, rank row: the most authoritative source, then the lowest rank."""
    df = gpu_jobs.filter(pl.col("job").is_not_null() & pl.col("gpu").is_not_null())
    if df.is_empty():
        return pl.DataFrame(schema={"node": pl.Utf8, "gpu": pl.Int32, "_job": pl.Utf8, "_rank": pl.Int32})
    prio = pl.col("source").replace_strict(SOURCE_PRIORITY, default=9, return_dtype=pl.Int32)
    return (
        df.with_columns(prio.alias("_p"))
        .sort(["node", "gpu", "_p", "rank"], nulls_last=True)
        .group_by("node", "gpu", maintain_order=True)
        .agg(pl.col("job").first().alias("_job"), pl.col("rank").first().alias("_rank"))
    )


def fill(df: pl.DataFrame, mapping: pl.DataFrame) -> pl.DataFrame:
    """`df` with null job/rank filled from the GPU's mapping (columns and types unchanged)."""
    if df.is_empty() or mapping.is_empty() or not {"node", "gpu", "job", "rank"} <= set(df.columns):
        return df
    cols = df.columns
    joined = df.join(mapping, on=["node", "gpu"], how="left")
    same_job = pl.col("job").is_null() | (pl.col("job") == pl.col("_job"))
    return joined.with_columns(
        pl.coalesce("job", "_job").alias("job"),
        pl.when(pl.col("rank").is_null() & same_job).then(pl.col("_rank")).otherwise(pl.col("rank")).cast(df.schema["rank"]).alias("rank"),
    ).select(cols)


def with_observed(allocations: pl.DataFrame, mapping: pl.DataFrame) -> pl.DataFrame:
    """The scheduler's allocations plus the node-observed ones on GPUs it did not place."""
    if mapping.is_empty():
        return allocations
    observed = mapping.select("node", "gpu", pl.col("_job").alias("job"), pl.col("_rank").alias("rank"))
    extra = observed.join(allocations.select("node", "gpu"), on=["node", "gpu"], how="anti")
    if extra.is_empty():
        return allocations
    return pl.concat([allocations, schemas.conform(extra, schemas.ALLOCATIONS, stream="allocations")], how="vertical_relaxed")


def latest_per_gpu(workloads: pl.DataFrame) -> pl.DataFrame:
    """Each GPU's newest rows: a tick may bring several scrapes (a replay whose step is longer
    than the recording's), and a workload that ended in the last of them is over."""
    return workloads.filter(pl.col("ts") == pl.col("ts").max().over(["node", "gpu"]))


def from_dcgm(workloads: pl.DataFrame) -> pl.DataFrame:
    """dcgm-exporter's own attribution labels (`hpc_job`, or `pod`/`namespace`) as `gpu_jobs` rows:
    on a DCGM-only node they are the job map."""
    pod_job = pl.when(pl.col("pod").is_not_null()).then(pl.format("{}/{}", pl.col("namespace").fill_null(""), pl.col("pod")))
    df = workloads.select(
        "ts", "node", "gpu", "gpu_uuid", pl.coalesce("hpc_job", pod_job).alias("job"), "pod", "namespace",
        pl.when(pl.col("hpc_job").is_not_null()).then(pl.lit("dcgm_hpc_job")).otherwise(pl.lit("dcgm_pod")).alias("source"),
    )
    return schemas.conform(df.filter(pl.col("job").is_not_null()), schemas.GPU_JOBS, stream="gpu_jobs")


class JobJoin:
    """Keeps the latest `gpu_jobs` and the scheduler's latest `allocations` across ticks."""

    def __init__(self) -> None:
        self.mapping: pl.DataFrame | None = None
        self._allocations: pl.DataFrame | None = None

    def apply(self, frames: list[tuple[str, pl.DataFrame]]) -> list[tuple[str, pl.DataFrame]]:
        new_map = [df for stream, df in frames if stream == "gpu_jobs"]
        new_map += [from_dcgm(latest_per_gpu(df)) for stream, df in frames if stream == "gpu_workloads" and df.height]
        new_alloc = [df for stream, df in frames if stream == "allocations"]
        if new_map:
            self.mapping = per_gpu(pl.concat(new_map, how="vertical_relaxed") if len(new_map) > 1 else new_map[0])
        if new_alloc:
            self._allocations = new_alloc[-1]
        if self.mapping is None:
            return frames
        out = [(s, fill(df, self.mapping) if s in FILLED_STREAMS else df) for s, df in frames if s != "allocations"]
        if new_alloc or new_map:
            base = self._allocations if self._allocations is not None else schemas.empty("allocations")
            out.append(("allocations", with_observed(base, self.mapping)))
        return out


__all__ = ["FILLED_STREAMS", "JobJoin", "fill", "per_gpu", "with_observed"]
