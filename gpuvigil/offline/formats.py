"""Reading saved files for `analyze`, `replay` and the HTML report: which recorded series a file
holds (from its first bytes) and the stream frames it gives, the time arguments, and the walk
over files and folders. The commands import this module; it imports none of them.

Series files: OpenMetrics / Prometheus text with sample timestamps (dcgm-exporter's and gpuvigil's
own series, mapped onto the streams as the live collectors map them), NVML CSV, hook JSONL.
Everything else (logs, dumps, single scrapes) is `analyze`'s to sniff and read.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import polars as pl

from gpuvigil import schemas, signals
from gpuvigil.collectors import dcgm
from gpuvigil.errors import UserError
from gpuvigil.exporter.metrics import IB_SPECS, IB_UP
from gpuvigil.model import Finding


def iter_files(paths: Iterable[Path]) -> list[Path | str]:
    """Files to read in argument order (folders walked, sorted), or an error line in their place."""
    items: list[Path | str] = []
    seen: set[Path] = set()
    for p in paths:
        if p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file() and not any(part.startswith(".") for part in f.relative_to(p).parts))
            if not found:
                items.append(f"{p}: folder has no files")
        elif p.is_file():
            found = [p]
        else:
            items.append(f"{p}: not a regular file" if p.exists() else f"{p}: no such file or folder")
            continue
        for f in found:
            key = f.resolve()
            if key not in seen:
                seen.add(key)
                items.append(f)
    return items


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
    parts = _gpu_sample_parts(long, named, out)
    if parts:
        samples, xids = _samples_with_xids(parts, last_xid)
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


def _gpu_sample_parts(long: pl.DataFrame, named: dict[tuple, bool] | None, out: dict[str, pl.DataFrame]) -> list[pl.DataFrame]:
    """`gpu_samples` rows from dcgm-exporter's series and from gpuvigil's own (one frame each
    present); dcgm-exporter's job map goes to `out["gpu_workloads"]`."""
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
    return parts


def _samples_with_xids(parts: list[pl.DataFrame], last_xid: dict[tuple, int | None] | None) -> tuple[pl.DataFrame, pl.DataFrame]:
    """The GPU samples as one frame with `xid_total` counted, and an `events` row per new XID."""
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
    return samples, xids


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

