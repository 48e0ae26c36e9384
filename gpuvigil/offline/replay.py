"""`gpuvigil replay`: what would gpuvigil have said about last month, on the data you already have?

Runs the streaming pipeline (every detector, the findings lifecycle and the hint rules) over
recorded history in recorded time: the clock is the recording's, one tick per `--step`, and each
tick sees exactly the samples recorded up to that moment. Reports every finding, page and hint
with the moment it would have fired, plus pages per GPU-day and per kind.

Sources (any mix):
- a Prometheus server: `--prometheus URL --start T --end T [--step S]` (T in RFC 3339 or unix
  seconds, as promtool takes them). dcgm-exporter series (`DCGM_FI_*`, labels `Hostname`/`gpu`/
  `UUID`/`pod`/`namespace`/`job`) and gpuvigil's own series (`gpuvigil_gpu_*`, `gpuvigil_rank_*`)
  are read through the HTTP API (`/api/v1/query_range`), in chunks under its 11,000-point limit;
- files: OpenMetrics / Prometheus text with sample timestamps, NVML CSV, hook JSONL (what the
  in-process hook publishes), and every log and dump `gpuvigil analyze` reads. Logs and dumps are
  diagnosed by the offline readers and fire at their own timestamps, through the same hint rules.

Untrusted input is read as `analyze` reads it (restricted unpickler for dumps).
"""

from __future__ import annotations

import argparse
import io
import collections
import json
import math
import re
import sys
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from gpuvigil import config, schemas, signals
from gpuvigil.collectors import dcgm
from gpuvigil.errors import UserError
from gpuvigil.exporter.metrics import IB_SPECS, IB_UP
from gpuvigil.model import Finding, Hint, Severity
from gpuvigil.pipeline.incidents import MESSAGE_ROLES

MIB = 1 << 20
MAX_POINTS_PER_QUERY = 10_000  # Prometheus refuses query_range answers above 11,000 points a series

# dcgm-exporter's fields, mapped onto `gpu_samples` as the live collector maps them
# (collectors/dcgm.py: frames_from_long, after gpuvigil/signals.py)
DCGM_FIELDS: tuple[str, ...] = signals.DCGM_FIELDS
# gpuvigil's own exporter series -> (column, factor to the column's unit), from gpuvigil/signals.py;
# `xid_total` is counted here from the last XID, as for dcgm-exporter's series
GPUVIGIL_GPU_FIELDS: dict[str, tuple[str, float]] = {k: v for k, v in signals.prometheus_fields().items() if v[0] != "xid_total"}
GPUVIGIL_RANK_FIELDS: dict[str, tuple[str, float]] = {
    "gpuvigil_rank_step_time_seconds": ("step_time_seconds", 1.0),
    "gpuvigil_rank_step": ("step", 1.0),
    "gpuvigil_rank_collective_enqueued_seq": ("last_enqueued_seq", 1.0),
    "gpuvigil_rank_collective_completed_seq": ("last_completed_seq", 1.0),
}
GPUVIGIL_ALLOC_FIELDS: dict[str, tuple[str, float]] = {
    "gpuvigil_rank_memory_allocated_bytes": ("allocated_bytes", 1.0),
    "gpuvigil_rank_memory_reserved_bytes": ("reserved_bytes", 1.0),
    "gpuvigil_rank_memory_largest_free_block_bytes": ("largest_free_block_bytes", 1.0),
}
# gpuvigil's own InfiniBand port series (exporter/metrics.py) -> (ib_ports column, factor to its
# unit); `gpuvigil_ib_port_up` gives the state (ACTIVE or not).
GPUVIGIL_IB_FIELDS: dict[str, tuple[str, float]] = {
    **{name + ("_total" if typ == "counter" else ""): (col, 1.0 / scale) for name, typ, col, _help, scale in IB_SPECS},
    IB_UP[0]: ("_up", 1.0),
}
ALL_FIELDS: tuple[str, ...] = (*DCGM_FIELDS, *GPUVIGIL_GPU_FIELDS, *GPUVIGIL_RANK_FIELDS, *GPUVIGIL_ALLOC_FIELDS, *GPUVIGIL_IB_FIELDS)
# counters may come back with or without the `_total` suffix (OpenMetrics drops it from the family)
_ALIASES = {k.removesuffix("_total"): k for k in ALL_FIELDS if k.endswith("_total")}

# One sample a row. The label columns: those of dcgm-exporter's series (collectors/dcgm.py:
# LABELS; the workload ones are read on DCGM series only), and job/rank of gpuvigil's rank series.
_DCGM_ATTRIBUTION = tuple(c for c in dcgm.LABELS if c not in ("node", "gpu", "gpu_uuid"))
_IB_LABELS = ("device", "port", "link_layer")  # of gpuvigil's InfiniBand port series only
_LABEL_COLUMNS = ("node", "gpu", "gpu_uuid", "job", "rank", *_DCGM_ATTRIBUTION, *_IB_LABELS)
LONG = pl.Schema({"ts": pl.Float64, "metric": pl.Utf8, "value": pl.Float64, **dict.fromkeys(_LABEL_COLUMNS, pl.Utf8)})


# -- time arguments ------------------------------------------------------------------------------
def parse_time(value: str) -> float:
    """RFC 3339 or unix seconds (as promtool and the Prometheus API take them)."""
    v = value.strip()
    try:
        return float(v)
    except ValueError:
        pass
    try:
        dt = datetime.fromisoformat(v.replace("Z", "+00:00"))
    except ValueError as exc:
        raise UserError(f"time {value!r}: expected RFC 3339 (2026-11-01T00:00:00Z) or unix seconds") from exc
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return dt.timestamp()


_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m|h|d)?$")


def parse_duration(value: str) -> float:
    m = _DURATION.match(value.strip())
    if not m:
        raise UserError(f"step {value!r}: expected seconds or a duration like 30s, 1m")
    n = float(m[1])
    return n * {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, None: 1}[m[2]]


# -- samples in long form -> stream frames ---------------------------------------------------------
def _labels_row(metric: str, labels: Mapping[str, str], ts: float, value: float) -> dict[str, Any]:
    known = dcgm.label_values(labels)
    is_dcgm = metric.startswith("DCGM_FI_")
    return {
        "ts": ts,
        "metric": _ALIASES.get(metric, metric),
        "value": value,
        "node": known["node"],
        "gpu": labels.get("gpu"),
        "gpu_uuid": known["gpu_uuid"],
        # Prometheus renames an exporter's own `job` label to `exported_job` (its `job` is the scrape job)
        "job": (labels.get("exported_job") or labels.get("job")) if metric.startswith("gpuvigil_rank") else None,
        "rank": labels.get("rank"),
        **{c: known[c] if is_dcgm else None for c in _DCGM_ATTRIBUTION},
        **{c: labels.get(c) if metric.startswith("gpuvigil_ib_") else None for c in _IB_LABELS},
    }


def streams_from_long(
    long: pl.DataFrame, last_xid: dict[tuple, int | None] | None = None, named: dict[tuple, bool] | None = None
) -> dict[str, pl.DataFrame]:
    """`gpu_samples`, `events` (XID changes), `gpu_workloads` (the job map from dcgm-exporter's
    labels), `rank_progress`, `allocator_stats` from long samples.

    `last_xid` ((node, gpu) -> last XID seen before these samples) carries DCGM's "last XID"
    across chunks of a long replay, so that an old XID is not counted again; `named` carries
    whether each GPU's latest row named a workload (collectors/dcgm.py: workload_changes). Both
    are updated."""
    out: dict[str, pl.DataFrame] = {}
    if long.is_empty():
        return out
    long = long.with_columns(pl.col("ts").round(3))
    parts: list[pl.DataFrame] = []
    d = long.filter(pl.col("metric").is_in(list(DCGM_FIELDS)))
    if d.height:
        # dcgm-exporter's series map exactly as the live collector maps a scrape, the job map
        # (`gpu_workloads`, from its pod/namespace/container and hpc_job labels) included
        dcgm_samples, workloads, _ = dcgm.frames_from_long(d)
        parts.append(dcgm_samples)
        workloads = dcgm.workload_changes(workloads, {} if named is None else named)
        if workloads.height:
            out["gpu_workloads"] = workloads
    g = long.filter(pl.col("metric").is_in(list(GPUVIGIL_GPU_FIELDS)))
    if g.height:
        g = g.with_columns(
            pl.col("metric").replace_strict({k: v[0] for k, v in GPUVIGIL_GPU_FIELDS.items()}).alias("col"),
            (pl.col("value") * pl.col("metric").replace_strict({k: float(v[1]) for k, v in GPUVIGIL_GPU_FIELDS.items()}, return_dtype=pl.Float64)).alias("v"),
            pl.col("gpu").cast(pl.Int32, strict=False),
        )
        # one GPU is (node, gpu): a UUID label present on some series only must not split it
        uuids = g.group_by(["node", "gpu"]).agg(pl.col("gpu_uuid").drop_nulls().first())
        wide = g.pivot(on="col", index=["ts", "node", "gpu"], values="v", aggregate_function="first").join(uuids, on=["node", "gpu"], how="left", nulls_equal=True)
        ints = [c for c in wide.columns if c in schemas.GPU_SAMPLES and schemas.GPU_SAMPLES[c].is_integer()]
        wide = wide.with_columns([pl.col(c).round(0) for c in ints])
        if "last_xid" in wide.columns:
            wide = wide.with_columns(pl.when(pl.col("last_xid") > 0).then(pl.col("last_xid")).alias("last_xid"))
        parts.append(schemas.conform(wide, "gpu_samples"))
    if parts:
        if len(parts) == 1:
            samples = parts[0]
        else:
            # a GPU both in dcgm-exporter's and in gpuvigil's own series: one row, DCGM's values first
            samples = schemas.conform(
                pl.concat(parts, how="vertical").group_by(["ts", "node", "gpu"], maintain_order=True).agg(pl.all().drop_nulls().first()), "gpu_samples"
            )
        samples = samples.drop("xid_total").sort(["node", "gpu", "ts"])
        # DCGM_FI_DEV_XID_ERRORS is the last XID, not a count: each change is a new XID
        before = pl.col("last_xid").shift(1).over(["node", "gpu"])
        if last_xid:
            carried = pl.DataFrame(
                [{"node": k[0], "gpu": k[1], "_carried": v} for k, v in last_xid.items()], schema={"node": pl.Utf8, "gpu": pl.Int32, "_carried": pl.Int32}
            )
            samples = samples.join(carried, on=["node", "gpu"], how="left", nulls_equal=True)
            first = pl.col("ts") == pl.col("ts").min().over(["node", "gpu"])
            before = pl.when(first).then(pl.col("_carried")).otherwise(before)
        samples = samples.with_columns(
            (pl.col("last_xid").is_not_null() & (pl.col("last_xid") != before).fill_null(True)).alias("_new_xid")
        ).with_columns(pl.col("_new_xid").cast(pl.Int64).cum_sum().over(["node", "gpu"]).alias("xid_total"))
        if last_xid is not None:
            for node, gpu, x in samples.group_by(["node", "gpu"]).agg(pl.col("last_xid").drop_nulls().last()).iter_rows():
                if x is not None:
                    last_xid[(node, gpu)] = x
        xids = samples.filter(pl.col("_new_xid")).select(
            "ts", "node", "gpu", pl.lit("dcgm").alias("source"), pl.lit("xid").alias("kind"), pl.col("last_xid").alias("xid"),
            pl.format("XID {} reported by dcgm-exporter (DCGM_FI_DEV_XID_ERRORS)", pl.col("last_xid")).alias("message"),
        )
        out["gpu_samples"] = schemas.conform(samples.sort("ts"), "gpu_samples")
        if xids.height:
            out["events"] = schemas.conform(xids.sort("ts"), "events")
    ib = long.filter(pl.col("metric").is_in(list(GPUVIGIL_IB_FIELDS)) & pl.col("device").is_not_null())
    if ib.height:
        out["ib_ports"] = _ib_ports(ib)
    for stream, fields in (("rank_progress", GPUVIGIL_RANK_FIELDS), ("allocator_stats", GPUVIGIL_ALLOC_FIELDS)):
        r = long.filter(pl.col("metric").is_in(list(fields)))
        if r.height == 0:
            continue
        r = r.with_columns(pl.col("metric").replace_strict({k: v[0] for k, v in fields.items()}).alias("col"), pl.col("rank").cast(pl.Int32, strict=False))
        wide = r.pivot(on="col", index=["ts", "job", "rank"], values="value", aggregate_function="first")
        ints = {"step", "last_enqueued_seq", "last_completed_seq", "allocated_bytes", "reserved_bytes", "largest_free_block_bytes"}
        wide = wide.with_columns([pl.col(c).round(0).cast(pl.Int64) for c in wide.columns if c in ints])
        out[stream] = schemas.conform(wide.sort("ts"), stream)
    return out


def _ib_ports(ib: pl.DataFrame) -> pl.DataFrame:
    """gpuvigil's InfiniBand port series -> `ib_ports` rows, one per port and time. The GPUs a port
    serves are not in its series: replayed ports are the node's (affinity `node`)."""
    key = ["ts", "node", "device", "port", "link_layer"]
    ib = ib.with_columns(
        pl.col("metric").replace_strict({k: v[0] for k, v in GPUVIGIL_IB_FIELDS.items()}).alias("col"),
        (pl.col("value") * pl.col("metric").replace_strict({k: float(v[1]) for k, v in GPUVIGIL_IB_FIELDS.items()}, return_dtype=pl.Float64)).alias("v"),
    )
    wide = ib.pivot(on="col", index=key, values="v", aggregate_function="first")
    ints = [c for c in wide.columns if c in schemas.IB_PORTS and schemas.IB_PORTS[c].is_integer() and c != "port"]
    wide = wide.with_columns(
        *[pl.col(c).round(0) for c in ints],
        pl.col("port").cast(pl.Int32, strict=False),
        (pl.when(pl.col("_up") == 1).then(pl.lit("ACTIVE")).when(pl.col("_up") == 0).then(pl.lit("DOWN")) if "_up" in wide.columns else pl.lit(None, pl.Utf8)).alias("state"),
        pl.lit([], pl.List(pl.Int32)).alias("gpus"),
        pl.lit("node").alias("affinity"),
    )
    return schemas.conform(wide.sort("ts"), "ib_ports")


# -- sources ---------------------------------------------------------------------------------------
def query_prometheus(url: str, start: float, end: float, step: float, *, client: Any = None, metrics: Iterable[str] = ALL_FIELDS) -> pl.DataFrame:
    """Every series of `metrics` in [start, end] at `step`, as LONG rows, through query_range."""
    import httpx

    names = sorted({m.removesuffix("_total") for m in metrics} | set(metrics))
    selector = '{__name__=~"' + "|".join(re.escape(n) for n in names) + '"}'
    own = client is None
    client = client or httpx.Client(timeout=120.0)
    frames: list[pl.DataFrame] = []
    chunk = step * MAX_POINTS_PER_QUERY
    try:
        t = start
        while t <= end:
            t_end = min(end, t + chunk - step)
            try:
                resp = client.get(f"{url.rstrip('/')}/api/v1/query_range", params={"query": selector, "start": f"{t:.3f}", "end": f"{t_end:.3f}", "step": f"{step:g}"})
                resp.raise_for_status()
                fast = long_from_query_body(resp.content)
                if fast is not None:
                    frames.append(fast)
                    t = t_end + step
                    continue
                body = resp.json()
            except (httpx.HTTPError, ValueError) as exc:
                raise UserError(f"{url}: query_range failed: {exc}") from exc
            if body.get("status") != "success":
                raise UserError(f"{url}: query_range: {body.get('error', body)}")
            try:
                frames.append(long_from_query_result(body["data"]["result"]))
            except (KeyError, TypeError, ValueError, pl.exceptions.PolarsError) as exc:
                raise UserError(f"{url}: query_range: unexpected answer: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from exc
            t = t_end + step
    finally:
        if own:
            client.close()
    return pl.concat(frames, how="vertical_relaxed") if frames else pl.DataFrame(schema=LONG)


# the labels `_labels_row` reads, and a query_range answer's shape with only those
_QUERY_LABELS = tuple(dict.fromkeys(("__name__", *(n for names in dcgm.LABELS.values() for n in names), "exported_job", "job", "rank", *_IB_LABELS)))
_QUERY_SCHEMA = pl.Schema(
    {
        "status": pl.Utf8,
        "data": pl.Struct(
            {
                "resultType": pl.Utf8,
                "result": pl.List(pl.Struct({"metric": pl.Struct(dict.fromkeys(_QUERY_LABELS, pl.Utf8)), "values": pl.List(pl.List(pl.Utf8))})),
            }
        ),
    }
)


def long_from_query_body(body: bytes) -> pl.DataFrame | None:
    """A successful query_range answer (the JSON bytes) -> LONG rows, parsed by polars' JSON
    reader (about half the CPU of json.loads and Python lists). None when the answer is not a
    plain successful matrix (an error, an odd shape): the caller then reads it with json, as
    before. Labels are still mapped per series by `_labels_row`."""
    try:
        # The schema is given, not inferred (inference scans the whole answer: ~40% of the CPU).
        # It names only the labels `_labels_row` reads: the reader skips the others, which
        # replay never looks at, so nothing it uses is lost.
        df = pl.read_json(io.BytesIO(body), schema=_QUERY_SCHEMA)
        if df.height != 1 or df["status"][0] != "success" or df.select(pl.col("data").struct.field("resultType")).item() != "matrix":
            return None
        res = df.select(pl.col("data").struct.field("result")).explode("result")
        if res["result"].null_count() == res.height:
            return pl.DataFrame(schema=LONG)
        res = res.unnest("result")
        bases = []
        for labels in res["metric"].to_list():
            labels = {k: v for k, v in (labels or {}).items() if v is not None}
            bases.append(_labels_row(labels.get("__name__", ""), labels, 0.0, 0.0))
        per_series = pl.DataFrame(bases, schema={c: pl.Utf8 for c in ("metric", *_LABEL_COLUMNS)}, strict=False)
        points = per_series.with_columns(res["values"]).explode("values").filter(pl.col("values").list.len() == 2)
        out = points.with_columns(
            pl.col("values").list.get(0).cast(pl.Float64, strict=False).alias("ts"),
            pl.col("values").list.get(1).cast(pl.Float64, strict=False).alias("value"),
        )
    except (pl.exceptions.PolarsError, ValueError, TypeError, KeyError):
        return None
    ok = pl.col("ts").is_not_null() & pl.col("value").is_not_null() & ~pl.col("value").is_nan()
    return out.filter(ok).select([pl.col(c).cast(t) for c, t in LONG.items()])


def long_from_query_result(result: Sequence[Mapping[str, Any]]) -> pl.DataFrame:
    """A query_range answer's `data.result` (matrix) -> LONG rows, as one frame: the points of
    every series flattened in one pass and the labels mapped once per series (a month of a fleet
    is millions of series-chunks: a frame per series cost more than the samples)."""
    bases: list[dict[str, Any]] = []
    counts: list[int] = []
    ts: list[Any] = []
    vs: list[Any] = []
    for series in result:
        values = series.get("values") or []
        if not values:
            continue
        labels = series["metric"]
        bases.append(_labels_row(labels.get("__name__", ""), labels, 0.0, 0.0))
        counts.append(len(values))
        t, v = zip(*values, strict=True)
        ts.extend(t)
        vs.extend(v)
    if not bases:
        return pl.DataFrame(schema=LONG)
    per_series = pl.DataFrame(bases, schema={c: pl.Utf8 for c in ("metric", *_LABEL_COLUMNS)}, strict=False)
    idx = np.repeat(np.arange(len(bases)), counts)
    out = per_series[idx].with_columns(
        pl.Series("ts", ts, dtype=pl.Float64, strict=False),
        pl.Series("value", vs, dtype=pl.Utf8, strict=False).cast(pl.Float64, strict=False),
    )
    ok = pl.col("ts").is_not_null() & pl.col("value").is_not_null() & ~pl.col("value").is_nan()
    return out.filter(ok).select([pl.col(c).cast(t) for c, t in LONG.items()])


def _label(name: str) -> pl.Expr:
    return pl.col("labels").str.extract(r'(?:^|,)\s*' + name + r'="((?:[^"\\]|\\.)*)"', 1)


# The exposition formats' escapes in label values, undone as prometheus_client's parser undoes
# them (prometheus_client/parser.py: ESCAPE_SEQUENCES): `\\`, `\"`, `\n`; any other backslash
# stays as it is. Scanned left to right, so `\\n` is a backslash and an `n`.
_ESCAPE = re.compile(r'\\[\\n"]')
_ESCAPES = {"\\\\": "\\", "\\n": "\n", '\\"': '"'}


def _unescape(value: str) -> str:
    return _ESCAPE.sub(lambda m: _ESCAPES[m.group(0)], value)


def _series_columns(series: pl.DataFrame) -> pl.DataFrame:
    """Distinct (metric, labels) text -> the LONG label columns, with the mapping of `_labels_row`."""
    metric = pl.col("metric").replace(_ALIASES)
    is_rank = metric.str.starts_with("gpuvigil_rank")
    is_dcgm = metric.str.starts_with("DCGM_FI_")

    def first_of(names: Sequence[str]) -> pl.Expr:  # the first present, non-empty (dcgm.label_values)
        return pl.coalesce([pl.when(_label(n) != "").then(_label(n)) for n in names])

    out = series.with_columns(
        metric.alias("_metric"),
        first_of(dcgm.LABELS["node"]).alias("node"),
        _label("gpu").alias("gpu"),
        first_of(dcgm.LABELS["gpu_uuid"]).alias("gpu_uuid"),
        pl.when(is_rank).then(pl.coalesce(_label("exported_job"), _label("job"))).alias("job"),
        _label("rank").alias("rank"),
        *[pl.when(is_dcgm).then(first_of(dcgm.LABELS[c])).alias(c) for c in _DCGM_ATTRIBUTION],
        *[pl.when(metric.str.starts_with("gpuvigil_ib_")).then(_label(c)).alias(c) for c in _IB_LABELS],
    )
    # escaped values are rare: undone in Python, once per distinct series that has one
    for c in _LABEL_COLUMNS:
        if out.get_column(c).str.contains("\\", literal=True).any():
            out = out.with_columns(pl.Series(c, [None if v is None else _unescape(v) for v in out.get_column(c).to_list()], dtype=pl.Utf8))
    return out


def _long_from_labelled(df: pl.DataFrame, key: list[str] | None = None, series: pl.DataFrame | None = None) -> pl.DataFrame:
    """(metric, labels, value, ts) text columns -> LONG. Labels are parsed once per distinct
    series (`key` columns; `series`: those keys already mapped, only the wanted ones), then
    joined onto its samples; samples of a series not in `series` are dropped."""
    key = key or ["metric", "labels"]
    series = _series_columns(df.select("metric", "labels").unique()) if series is None else series
    return df.select(
        pl.col("ts").cast(pl.Float64, strict=False).alias("ts"),
        *key,
        pl.col("value").cast(pl.Float64, strict=False).alias("value"),
    ).filter(pl.col("ts").is_not_null() & pl.col("value").is_not_null() & ~pl.col("value").is_nan()).join(
        series, on=key, how="inner", nulls_equal=True, maintain_order="left"
    ).select("ts", pl.col("_metric").alias("metric"), "value", *_LABEL_COLUMNS)


CHUNK_SECONDS = 6 * 3600.0  # a Prometheus replay fetches and holds this much history at a time


def prometheus_chunks(url: str, start: float, end: float, step: float, chunk_seconds: float = CHUNK_SECONDS) -> Iterable[tuple[float, dict[str, pl.DataFrame]]]:
    """(until, streams) for consecutive windows of a Prometheus server's history."""
    last_xid: dict[tuple, int | None] = {}
    named: dict[tuple, bool] = {}
    t = start
    while t <= end:
        until = min(end, t + chunk_seconds - step)
        yield until, streams_from_long(query_prometheus(url, t, until, step), last_xid, named)
        t = until + step


_LINE = r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+(\S+))?\s*$"
_HEAD = r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?$"
READ_CHUNK_BYTES = 256 << 20  # text is read this much at a time (a month of a fleet is ~100 GB)


def _split_regex(lines: pl.DataFrame) -> pl.DataFrame:
    """(metric, labels, value, ts) text columns of sample lines, one regex per line: the
    reference reading, used for every line the fast split below does not vouch for."""
    out = lines.select(pl.col("line").str.extract_groups(_LINE).alias("m")).unnest("m")
    out.columns = ["metric", "labels", "value", "ts"]
    return out


def _split_fast(lines: pl.DataFrame, *, plain_whitespace: bool = False) -> tuple[pl.DataFrame, pl.DataFrame, pl.DataFrame]:
    """(metric, labels, value, ts) of the lines shaped `HEAD VALUE TS`, single spaces and no other
    whitespace, split with literal searches: HEAD ends at the first `} ` (or the first space when
    the line has none) and must read whole as `NAME` or `NAME{LABELS}`; the head is read once per
    distinct series (a series repeats on every line of its history). Returns ((head, value, ts),
    (head, metric, labels) per distinct head, the other lines): the others go through
    `_split_regex`. `plain_whitespace`: the caller checked that no line holds whitespace other
    than the ASCII space (a check per block, not a regex per line).

    On the lines it keeps this gives exactly what `_split_regex` gives (tests/test_replay.py
    checks both agree on generated and random text). Why the first `} ` is enough: the reference
    pattern ends the labels at the last `}` followed by whitespace; a later one would sit in the
    VALUE or TS field, which then is no number and the sample is dropped either way, or makes
    more than two fields, which sends the line to the regex."""
    line = pl.col("line")
    cut = pl.coalesce(line.str.find("} ", literal=True) + 1, line.str.find(" ", literal=True))
    df = lines.with_columns(cut.alias("_cut"))
    df = df.with_columns(
        line.str.slice(0, pl.col("_cut")).alias("head"),
        line.str.slice(pl.col("_cut") + 1).str.split_exact(" ", 2).alias("_t"),
    ).unnest("_t")
    ok = pl.col("_cut").is_not_null() & (pl.col("field_0").str.len_bytes() > 0) & (pl.col("field_1").str.len_bytes() > 0) & pl.col("field_2").is_null()
    if not plain_whitespace:
        # any whitespace but the ASCII space (tabs, Unicode spaces) is left to the regex
        ok = ok & ~line.str.contains(r"[\s&&[^ ]]")
    fast = df.filter(ok)
    rest = df.filter(~ok.fill_null(False)).select("line")
    heads = fast.select(pl.col("head").unique()).with_columns(pl.col("head").str.extract_groups(_HEAD).alias("m")).unnest("m")
    heads.columns = ["head", "metric", "labels"]
    # a head the reference pattern does not read whole (a `} ` inside a label value...) -> regex
    bad = heads.filter(pl.col("metric").is_null())
    if bad.height:
        rest = pl.concat([rest, fast.join(bad.select("head"), on="head", how="semi").select("line")])
        fast = fast.join(bad.select("head"), on="head", how="anti")
        heads = heads.filter(pl.col("metric").is_not_null())
    return fast.select("head", pl.col("field_0").alias("value"), pl.col("field_1").alias("ts")), heads, rest


def _plain_whitespace(block: bytes) -> bool:
    """No whitespace in `block` but ASCII spaces and newlines (true of every exporter's output):
    ASCII only (so no Unicode space) and none of tab, CR, VT, FF. Bytes scans, a few ms per
    256 MiB."""
    return block.isascii() and not any(c in block for c in (b"\t", b"\r", b"\x0b", b"\x0c"))


def _text_chunks(path: Path, size: int = READ_CHUNK_BYTES) -> Iterable[bytes]:
    with open(path, "rb") as fh:
        tail = b""
        while True:
            block = fh.read(size)
            if not block:
                if tail:
                    yield tail
                return
            block = tail + block
            cut = block.rfind(b"\n")
            if cut < 0:
                tail = block
                continue
            tail = block[cut + 1 :]
            yield block[: cut + 1]


def _exemplar_lines(lines: list[str], wanted: Sequence[str]) -> tuple[list[dict[str, Any]], int]:
    """LONG rows of sample lines carrying an OpenMetrics exemplar, read one by one by
    prometheus_client's OpenMetrics sample parser (rare lines: Python speed is fine), and how
    many it refused. The exemplar itself is not a sample of the series and is dropped."""
    from prometheus_client.openmetrics.parser import _parse_sample

    keep = set(wanted)
    rows: list[dict[str, Any]] = []
    unread = 0
    for text in lines:
        try:
            sample = _parse_sample(text.strip(" "))
            value = float(sample.value)
        except Exception:  # an untrusted line: any refusal counts it as unreadable, nothing more
            unread += 1
            continue
        ts = sample.timestamp
        if ts is None or sample.name not in keep or math.isnan(value):
            continue
        # a Timestamp(sec, nsec) -> the float its decimal text reads as (as the fast path reads it)
        t = float(f"{ts.sec}.{ts.nsec:09d}") if hasattr(ts, "nsec") else float(ts)
        rows.append(_labels_row(sample.name, sample.labels, t, value))
    return rows, unread


def read_exposition_file(path: Path, *, fast: bool = True, chunk_bytes: int = READ_CHUNK_BYTES) -> pl.DataFrame:
    """OpenMetrics or Prometheus text whose samples carry timestamps, as LONG rows.

    Read column-wise with polars, a chunk of the file at a time, keeping only the series replay
    maps (a month of a fleet is hundreds of millions of lines): plain sample lines are split with
    literal searches and each distinct series' labels parsed once; any other line goes through
    the one-regex-per-line reading (`fast=False`: every line does). OpenMetrics stamps are
    seconds; Prometheus text stamps are milliseconds.
    """
    wanted = sorted(set(ALL_FIELDS) | set(_ALIASES))
    parts: list[pl.DataFrame] = []
    openmetrics = False
    sample_lines = bad = 0
    try:
        for block in _text_chunks(path, chunk_bytes):
            raw = pl.read_csv(block, has_header=False, separator="\x1f", quote_char=None, new_columns=["line"], schema={"line": pl.Utf8}, truncate_ragged_lines=True)
            raw = raw.filter(pl.col("line").is_not_null())
            openmetrics = openmetrics or raw.filter(pl.col("line").str.starts_with("# EOF")).height > 0
            lines = raw.filter(~pl.col("line").str.starts_with("#"))
            if fast:
                split, heads, rest = _split_fast(lines, plain_whitespace=_plain_whitespace(block))
                heads = heads.filter(pl.col("metric").is_in(wanted))
                sample_lines += split.height
                if heads.height:
                    # an inner join keeps only the wanted series' samples (no semi-join pass)
                    parts.append(_long_from_labelled(split, ["head"], _series_columns(heads)))
            else:
                rest = lines
            # blank lines are no samples; whitespace-only ones never pass the fast split
            rest = rest.filter(pl.col("line").str.strip_chars() != "")
            sample_lines += rest.height
            # An OpenMetrics exemplar (`... VALUE TS # {trace_id="..."} 1 TS`) would make the
            # pattern below read the exemplar's value: such lines go to prometheus_client.
            marked = rest.get_column("line").str.contains(" # ", literal=True)
            if marked.any():
                rows, unread = _exemplar_lines(rest.filter(marked).get_column("line").to_list(), wanted)
                bad += unread
                if rows:
                    parts.append(pl.DataFrame(rows, schema=LONG, orient="row"))
                rest = rest.filter(~marked)
            samples = _split_regex(rest)
            bad += samples.filter(pl.col("metric").is_null()).height
            kept = samples.filter(pl.col("metric").is_in(wanted) & pl.col("ts").is_not_null())
            if kept.height:
                parts.append(_long_from_labelled(kept))
    except (OSError, pl.exceptions.PolarsError) as exc:
        raise UserError(f"{path}: unreadable: {str(exc).splitlines()[0]}") from exc
    if bad and bad == sample_lines:
        raise UserError(f"{path}: not an OpenMetrics/Prometheus exposition")
    df = pl.concat(parts, rechunk=True) if parts else pl.DataFrame(schema=LONG)
    if df.is_empty():
        raise UserError(f"{path}: no timestamped samples of a known series (a single scrape: use `gpuvigil analyze`)")
    if not openmetrics and df["ts"].max() > 1e11:  # type: ignore[operator]
        # numpy's division is IEEE (correctly rounded, as Python's and prometheus_client's);
        # polars' scalar division may multiply by the reciprocal (last-bit differences)
        df = df.with_columns(pl.Series("ts", df.get_column("ts").to_numpy() / 1000.0))
    return df


def read_hook_jsonl(path: Path) -> dict[str, pl.DataFrame]:
    from gpuvigil.collectors.hook import rows_from_record

    progress: list[dict] = []
    alloc: list[dict] = []
    with open(path, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            try:
                p, a = rows_from_record(json.loads(line))
            except (ValueError, TypeError):
                continue
            progress.extend(p)
            alloc.extend(a)
    out = {}
    if progress:
        out["rank_progress"] = schemas.frame(progress, "rank_progress").sort("ts")
    if alloc:
        out["allocator_stats"] = schemas.frame(alloc, "allocator_stats").sort("ts")
    return out


def _is_exposition(head: str) -> bool:
    return bool(re.search(r"^(?:# (?:HELP|TYPE) \w+|[A-Za-z_:][\w:]*(?:\{[^}]*\})? [-+0-9.eEInfNa]+ \d{9,})", head, re.MULTILINE))


def _is_hook_jsonl(head: str) -> bool:
    first = head.lstrip().split("\n", 1)[0]
    if not first.startswith("{"):
        return False
    try:
        rec = json.loads(first)
    except ValueError:
        return False
    return isinstance(rec, dict) and "rank" in rec and "ts" in rec and ("memory" in rec or "pg_status" in rec or "step" in rec)


def _is_nvml_csv(head: str) -> bool:
    cols = {c.strip() for c in head.split("\n", 1)[0].split(",")}
    return {"t", "fb_used"} <= cols


def series_kind(head: str) -> str | None:
    """Which recorded series a file holds, from its first bytes: "nvml_csv", "hook_jsonl",
    "exposition" (Prometheus/OpenMetrics text whose samples carry timestamps), or None (a log, a
    dump, a single scrape: `analyze` reads those)."""
    if _is_nvml_csv(head):
        return "nvml_csv"
    if _is_hook_jsonl(head):
        return "hook_jsonl"
    if _is_exposition(head) and re.search(r"\}? [-+0-9.eE]+ \d{9,}(?:\.\d+)?\s*$", head, re.MULTILINE):
        return "exposition"
    return None


def read_series_file(path: Path, head: str, *, node: str) -> dict[str, pl.DataFrame] | None:
    """A recorded series file (`series_kind`) as stream frames; None if it is none. Replay and
    the HTML report read saved series through this one function. Raises UserError."""
    kind = series_kind(head)
    if kind == "nvml_csv":
        from gpuvigil.collectors import nvml

        return {"gpu_samples": nvml.replay_csv(path, node=node).sort("ts")}
    if kind == "hook_jsonl":
        return read_hook_jsonl(path)
    if kind == "exposition":
        return streams_from_long(read_exposition_file(path))
    return None


@dataclass
class Recorded:
    """Recorded history: stream frames for the pipeline and offline findings from logs/dumps."""

    frames: dict[str, list[pl.DataFrame]] = field(default_factory=dict)
    offline: list[Finding] = field(default_factory=list)
    read: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    placed: dict[str, tuple[float, str]] = field(default_factory=dict)  # undated input -> (where, how)

    def add(self, streams: Mapping[str, pl.DataFrame]) -> None:
        for k, df in streams.items():
            if df.height:
                self.frames.setdefault(k, []).append(df)

    def stream(self, name: str) -> pl.DataFrame:
        parts = self.frames.get(name, [])
        if not parts:
            return schemas.empty(name)
        return pl.concat(parts, how="vertical_relaxed").sort("ts")

    def span(self) -> tuple[float, float] | None:
        lo, hi = math.inf, -math.inf
        for name in self.frames:
            ts = self.stream(name)["ts"]
            lo, hi = min(lo, ts.min()), max(hi, ts.max())  # type: ignore[type-var]
        for f in self.offline:
            if f.ts > 10 * 365 * 86400:  # since-boot stamps are not on the recording's clock
                lo, hi = min(lo, f.ts), max(hi, f.ts)
        return None if lo == math.inf else (float(lo), float(hi))


def load_files(
    paths: Sequence[Path], recorded: Recorded, *, node: str | None = None, job: str | None = None, cfg: dict[str, Any] | None = None, at: float | None = None
) -> None:
    """Series files into streams; everything else through `analyze`'s offline readers (`at`:
    where inputs with no timestamps of their own are placed; default their file's time)."""
    from gpuvigil.offline.analyze import Analyzer, _iter_files

    rest: list[Path] = []
    for item in _iter_files(paths):
        if isinstance(item, str):
            recorded.errors.append(item)
            continue
        try:
            with open(item, "rb") as fh:
                head = fh.read(64 * 1024).decode("utf-8", errors="replace")
        except OSError as exc:
            recorded.errors.append(f"{item}: unreadable: {exc.strerror or exc}")
            continue
        try:
            streams = read_series_file(item, head, node=node or "replay")
            if streams is None:
                rest.append(item)
                continue
            recorded.add(streams)
        except UserError as exc:
            recorded.errors.append(str(exc).splitlines()[0])
            continue
        recorded.read.append(str(item))
    if rest:
        report = Analyzer(cfg=cfg, job=job, node=node, at=at).run(rest)
        recorded.offline.extend(report.findings)
        recorded.placed.update(report.placed)
        recorded.read.extend(report.read)
        recorded.errors.extend(report.errors)


# -- the replay ------------------------------------------------------------------------------------
class ReplayCollector:
    """Hands the pipeline, at each tick, exactly the recorded rows stamped since the last tick."""

    name = "replay"

    def __init__(self, streams: Mapping[str, pl.DataFrame]):
        self.errors = 0
        self._frames = {k: v.sort("ts") for k, v in streams.items() if v.height}
        self._ts = {k: v["ts"].to_numpy() for k, v in self._frames.items()}
        self._pos = dict.fromkeys(self._frames, 0)
        self.streams = {k: schemas.STREAMS[k] for k in self._frames if k in schemas.STREAMS}

    def extend(self, streams: Mapping[str, pl.DataFrame]) -> None:
        """Append later recorded rows (the next chunk of a long replay); rows already handed out
        are dropped, so memory stays one chunk."""
        for k, new in streams.items():
            if new.height == 0:
                continue
            old = self._frames.get(k)
            rest = old.slice(self._pos[k]) if old is not None else None
            df = pl.concat([rest, new], how="vertical_relaxed") if rest is not None and rest.height else new
            self._frames[k] = df.sort("ts")
            self._ts[k] = self._frames[k]["ts"].to_numpy()
            self._pos[k] = 0
            if k in schemas.STREAMS:
                self.streams[k] = schemas.STREAMS[k]

    def collect(self, now: float) -> dict[str, pl.DataFrame]:
        out = {}
        for k, df in self._frames.items():
            end = int(np.searchsorted(self._ts[k], now, side="right"))
            start = self._pos[k]
            if end > start:
                out[k] = df.slice(start, end - start)
                self._pos[k] = end
        return out


@dataclass
class Fired:
    at: float  # recorded time the pipeline first raised it
    finding: Finding


@dataclass
class FiredHint:
    at: float
    hint: Hint


@dataclass
class ReplayResult:
    findings: list[Fired]
    hints: list[FiredHint]
    start: float
    end: float
    step: float
    ticks: int
    gpus: int
    wall_seconds: float
    samples: dict[str, int]
    errors: list[str] = field(default_factory=list)
    read: list[str] = field(default_factory=list)
    placed: dict[str, tuple[float, str]] = field(default_factory=dict)  # undated input -> (where, how)
    gpu_samples: pl.DataFrame | None = None  # kept for the report's memory plot
    rank_progress: pl.DataFrame | None = None  # ... and its progress heat map

    @property
    def pages(self) -> list[Fired]:
        """The pages on-call would have received: a page that joined an incident as evidence
        (the incident had already paged about that place) was never sent."""
        return [f for f in self.findings if f.finding.severity == Severity.PAGE and f.finding.incident_role in (None, *MESSAGE_ROLES)]

    def summary(self) -> dict[str, Any]:
        days = max((self.end - self.start) / 86400.0, 1e-9)
        gpu_days = max(self.gpus, 1) * days
        by_kind = Counter(f.finding.kind.value for f in self.pages)
        return {
            "record": "summary",
            "start": self.start,
            "end": self.end,
            "step_seconds": self.step,
            "ticks": self.ticks,
            "gpus": self.gpus,
            "gpu_days": round(gpu_days, 4),
            "findings": len(self.findings),
            "pages": len(self.pages),
            "hints": len(self.hints),
            "pages_per_gpu_day": round(len(self.pages) / gpu_days, 6),
            "pages_by_kind": dict(sorted(by_kind.items())),
            "pages_per_gpu_day_by_kind": {k: round(v / gpu_days, 6) for k, v in sorted(by_kind.items())},
            "samples": self.samples,
            "wall_seconds": round(self.wall_seconds, 3),
        }


def prefetch(items: Iterable[Any], depth: int = 1) -> Iterable[Any]:
    """`items` produced `depth` ahead in a background thread: the next chunk's fetch, JSON read and
    conversion (polars, which releases the GIL) overlap the pipeline's ticks over this one. Same
    items, same order; memory is `depth` + 1 chunks; an error in the producer is raised here."""
    import queue
    import threading

    q: queue.Queue = queue.Queue(maxsize=depth)
    done = object()
    stop = threading.Event()

    def produce() -> None:
        try:
            for item in items:
                while not stop.is_set():
                    try:
                        q.put((True, item), timeout=0.2)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            q.put((True, done))
        except BaseException as exc:  # handed to the consumer, raised there
            q.put((False, exc))

    thread = threading.Thread(target=produce, name="replay-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            ok, item = q.get()
            if not ok:
                raise item
            if item is done:
                return
            yield item
    finally:
        stop.set()


REPORT_SAMPLES_MAX = 2_000_000  # gpu_samples kept for the report's memory plot only below this


def run_replay(
    recorded: Recorded,
    *,
    cfg: dict[str, Any] | None = None,
    step: float = 30.0,
    start: float | None = None,
    end: float | None = None,
    chunks: Any = None,
) -> ReplayResult:
    """Tick the pipeline over [start, end]. `chunks`, if given, yields (until, streams): the
    recorded rows up to `until`, fetched lazily (a Prometheus replay of a month holds one chunk)."""
    from gpuvigil.app import compose
    from gpuvigil.pipeline.hints import HintPolicy

    cfg = config.defaults() if cfg is None else cfg
    streams = {k: recorded.stream(k) for k in recorded.frames}
    span = recorded.span()
    if span is None and (start is None or end is None):
        raise UserError("nothing recorded to replay (no series and no dated findings)")
    t0 = start if start is not None else span[0]  # type: ignore[index]
    t1 = end if end is not None else span[1]  # type: ignore[index]
    if t1 < t0:
        raise UserError("--end is before --start")
    collector = ReplayCollector(streams)
    pipeline = compose.build(cfg, "replay", [collector])
    fired: list[Fired] = []
    hints: list[FiredHint] = []
    w0 = time.perf_counter()
    # No recorded series (logs and dumps only): nothing for the streaming detectors to tick over.
    n_ticks = int(math.floor((t1 - t0) / step)) + 1 if (streams or chunks is not None) else 0
    seen: dict[str, int] = {k: v.height for k, v in streams.items()}
    gpu_keys: set[tuple] = set(streams["gpu_samples"].select("node", "gpu").unique().rows()) if "gpu_samples" in streams else set()
    kept: list[pl.DataFrame] = [streams["gpu_samples"]] if "gpu_samples" in streams else []
    it = prefetch(chunks) if chunks is not None else None
    # Logs and dumps: diagnosed offline, fired at their own time (clamped to the replayed span).
    offline = sorted(((min(max(f.ts if f.ts > 10 * 365 * 86400 else t0, t0), t1), f) for f in recorded.offline), key=lambda x: x[0])
    offline_at = list(offline)
    pending = collections.deque(offline)
    fetched_until = -math.inf if it is not None else math.inf
    for i in range(n_ticks):
        now = t0 + i * step
        while now > fetched_until and it is not None:
            nxt = next(it, None)
            if nxt is None:
                it, fetched_until = None, math.inf
                break
            fetched_until, part = nxt
            collector.extend(part)
            for k, v in part.items():
                seen[k] = seen.get(k, 0) + v.height
            if "gpu_samples" in part and part["gpu_samples"].height:
                gpu_keys |= set(part["gpu_samples"].select("node", "gpu").unique().rows())
                if sum(x.height for x in kept) + part["gpu_samples"].height <= REPORT_SAMPLES_MAX:
                    kept.append(part["gpu_samples"].select("ts", "node", "gpu", "memory_used_bytes", "memory_total_bytes"))
        while pending and pending[0][0] <= now:  # dated log/dump findings join incidents in time order
            at, f = pending.popleft()
            pipeline.incidents.observe([f], at)
        res = pipeline.tick(now)
        fired.extend(Fired(now, f) for f in (*res.new_findings, *res.escalated_findings))
        hints.extend(FiredHint(now, h) for h in res.new_hints)
    if it is not None:
        it.close()  # type: ignore[attr-defined]  # stops the prefetch thread
    for at, f in pending:  # after the last tick
        pipeline.incidents.observe([f], at)
    # ... through the same hint rules.
    policy = HintPolicy(cfg)
    for at, f in offline_at:
        fired.append(Fired(at, f))
        hints.extend(FiredHint(at, h) for h in policy.hints_for(f))
    fired.sort(key=lambda x: (x.at, x.finding.ts))
    hints.sort(key=lambda x: x.at)
    gs = pl.concat(kept, how="diagonal_relaxed") if kept and sum(x.height for x in kept) <= REPORT_SAMPLES_MAX else None
    gpus = len(gpu_keys)
    return ReplayResult(
        findings=fired,
        hints=hints,
        start=t0,
        end=t1,
        step=step,
        ticks=n_ticks,
        gpus=gpus,
        wall_seconds=time.perf_counter() - w0,
        samples=seen,
        errors=list(recorded.errors),
        read=list(recorded.read),
        placed=dict(recorded.placed),
        gpu_samples=gs,
        rank_progress=streams.get("rank_progress"),
    )


# -- output ----------------------------------------------------------------------------------------
def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def json_records(result: ReplayResult, policy: Any) -> Iterable[dict[str, Any]]:
    from gpuvigil.offline.analyze import to_json_line

    for f in result.findings:
        yield {"record": "finding", "fired_at": f.at, **to_json_line(f.finding, policy), "incident": f.finding.incident, "incident_role": f.finding.incident_role}
    for h in result.hints:
        d = h.hint.model_dump(mode="json")
        yield {"record": "hint", "fired_at": h.at, **d}
    yield result.summary()


def format_text(result: ReplayResult, policy: Any) -> str:
    from gpuvigil.offline.analyze import format_text as finding_text

    blocks = []
    for f in result.findings:
        blocks.append(f"fired at {_iso(f.at)}\n" + finding_text(f.finding, policy))
    for h in result.hints:
        hint = h.hint
        where = ", ".join(x for x in (f"job {hint.job}" if hint.job else "", f"node {hint.node}" if hint.node else "", f"gpu {hint.gpu}" if hint.gpu is not None else "") if x)
        blocks.append(f"hint {hint.action.value} at {_iso(h.at)}" + (f" ({where})" if where else "") + f"\n  {hint.reason}")
    s = result.summary()
    by_kind = ", ".join(f"{k} {v} ({s['pages_per_gpu_day_by_kind'][k]:.4g}/GPU-day)" for k, v in s["pages_by_kind"].items()) or "none"
    tail = (
        f"replayed {_iso(result.start)} .. {_iso(result.end)} at {result.step:g} s ({result.ticks} ticks, {result.gpus} GPU(s), {s['gpu_days']:.3g} GPU-days) in {result.wall_seconds:.1f} s\n"
        f"{s['findings']} finding(s), {s['pages']} page(s) = {s['pages_per_gpu_day']:.4g} per GPU-day; {s['hints']} hint(s)\n"
        f"pages by kind: {by_kind}"
    )
    return ("\n\n".join(blocks) + "\n\n" if blocks else "") + tail + "\n"


def handler(args: argparse.Namespace) -> int:
    try:
        cfg = config.load(args.config) if args.config else config.defaults()
    except config.ConfigError as exc:
        raise UserError(str(exc)) from exc
    if not args.prometheus and not args.paths:
        raise UserError("nothing to replay: give --prometheus URL --start T --end T and/or files")
    step = parse_duration(args.step)
    if step <= 0:
        raise UserError("--step must be positive")
    start = parse_time(args.start) if args.start else None
    end = parse_time(args.end) if args.end else None
    recorded = Recorded()
    chunks = None
    if args.prometheus:
        if start is None or end is None:
            raise UserError("--prometheus needs --start and --end")
        chunks = prometheus_chunks(args.prometheus, start, end, step)
        recorded.read.append(args.prometheus)
    if args.paths:
        load_files([Path(p) for p in args.paths], recorded, node=args.node, job=args.job, cfg=cfg, at=parse_time(args.at) if args.at else None)
    for err in recorded.errors:
        print(f"gpuvigil replay: {err}", file=sys.stderr)
    if not recorded.read:
        raise UserError("nothing could be read" + (f" ({len(recorded.errors)} error(s) above)" if recorded.errors else ""))
    result = run_replay(recorded, cfg=cfg, step=step, start=start, end=end, chunks=chunks)
    from gpuvigil.pipeline.hints import HintPolicy

    policy = HintPolicy(cfg)
    if args.format == "json":
        for rec in json_records(result, policy):
            sys.stdout.write(json.dumps(rec, default=str) + "\n")
    else:
        sys.stdout.write(format_text(result, policy))
    if args.report:
        from gpuvigil.offline import report

        report.write_replay_report(result, Path(args.report), cfg)
        print(f"gpuvigil replay: report written to {args.report}", file=sys.stderr)
    sys.stdout.flush()
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("replay", help="what gpuvigil would have said: replay recorded history (Prometheus, files) through every detector", description=__doc__.split("\n\n")[0])
    p.add_argument("paths", nargs="*", metavar="PATH", help="OpenMetrics/Prometheus text with timestamps, NVML CSV, hook JSONL, logs and dumps")
    p.add_argument("--prometheus", metavar="URL", help="Prometheus server to read dcgm-exporter and gpuvigil series from (HTTP API)")
    p.add_argument("--start", metavar="T", help="start of the replay (RFC 3339 or unix seconds); default: first recorded sample")
    p.add_argument("--end", metavar="T", help="end of the replay (RFC 3339 or unix seconds); default: last recorded sample")
    p.add_argument("--step", default="30s", help="tick and query resolution (seconds or 30s/1m; default 30s)")
    p.add_argument("--format", choices=["text", "json"], default="text", help="text (default) or JSON lines: findings, hints and a summary")
    p.add_argument("--report", metavar="FILE.html", help="also write a self-contained HTML report with plots")
    p.add_argument("--at", metavar="TIME", help="place logs and dumps with no timestamps of their own at TIME (RFC 3339 or unix seconds); default: each file's modification time")
    p.add_argument("--job", help="job name for logs that do not name one")
    p.add_argument("--node", help="node name for files that do not name their host")
    p.add_argument("--config", help="YAML/JSON config overriding thresholds and hint rules")
    p.set_defaults(func=handler)


__all__ = ["Recorded", "ReplayCollector", "ReplayResult", "run_replay", "query_prometheus", "streams_from_long", "load_files", "read_series_file", "series_kind", "parse_time", "parse_duration", "add_parser"]
