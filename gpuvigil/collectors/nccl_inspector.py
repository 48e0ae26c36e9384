"""NCCL Inspector ingest (L1): per-rank, per-communicator collective progress with no code change.

The NCCL Inspector is NCCL's profiler plugin (`ext-profiler/inspector` in NVIDIA/nccl). The
scheduler turns it on through the job's environment (deploy/slurm-taskprolog-l1.sh):
`NCCL_PROFILER_PLUGIN=<path>/libnccl-profiler-inspector.so`, `NCCL_INSPECTOR_ENABLE=1`,
`NCCL_INSPECTOR_DUMP_THREAD_INTERVAL_MICROSECONDS`, `NCCL_INSPECTOR_DUMP_DIR=<root>/<job>/`. Two
output modes, both read here into the `collective_progress` stream:

- JSON (default): files that grow by one JSON object per completed collective per communicator:
  `{"header": {"id", "rank", "n_ranks", "nnodes"}, "metadata": {"dump_timestamp_us", "hostname",
  "pid", ...}, "coll_perf": {"coll", "coll_sn", "coll_msg_size_bytes", "coll_exec_time_us",
  "coll_algobw_gbs", "coll_busbw_gbs", ...}}`; read incrementally (new bytes only).
- Prometheus textfile (`NCCL_INSPECTOR_PROM_DUMP=1`): `nccl_inspector_metrics_<GPU UUID>.prom`,
  rewritten every interval (30 s minimum) with the latest collective per communicator:
  `nccl_collective_exec_time_microseconds`, `nccl_bus_bandwidth_gbs`, `nccl_algorithm_bandwidth_gbs`
  labelled comm_id, hostname, rank, slurm_job, slurm_job_id, nranks, n_nodes, gpu_device_id
  ("GPU4"), collective, coll_sn, timestamp, message_size ("2.00GB").

The job is the folder under `root` (one dump dir per job), else the `slurm_job_id` label. The
files are untrusted: a malformed record is counted in `errors` and skipped.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import polars as pl
from prometheus_client.parser import text_string_to_metric_families

from gpuvigil import schemas
from gpuvigil.collectors.tail import FileTail

STREAMS: Mapping[str, pl.Schema] = {"collective_progress": schemas.COLLECTIVE_PROGRESS}
MAX_READ_BYTES = 64 << 20  # per file per collect
_SIZE = re.compile(r"^\s*([0-9.]+)\s*(B|KB|MB|GB|TB)\s*$")
_UNITS = {"B": 1, "KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30, "TB": 1 << 40}
_GPU = re.compile(r"(\d+)$")


def _int(v: Any) -> int | None:
    if isinstance(v, bool) or v is None:
        return None
    try:
        return int(v)
    except (TypeError, ValueError):
        try:
            return int(float(v))
        except (TypeError, ValueError, OverflowError):
            return None


def _float(v: Any) -> float | None:
    if isinstance(v, bool) or v is None:
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if f == f and abs(f) != float("inf") else None


def _size(text: Any) -> int | None:
    m = _SIZE.match(str(text or ""))
    return int(float(m.group(1)) * _UNITS[m.group(2)]) if m else None


def json_record(obj: Any, job: str | None, now: float) -> dict | None:
    """One Inspector JSON object → a `collective_progress` row (None if it is not one)."""
    if not isinstance(obj, dict):
        return None
    header, meta, perf = obj.get("header"), obj.get("metadata"), obj.get("coll_perf")
    if not isinstance(header, dict) or not isinstance(perf, dict):
        return None
    meta = meta if isinstance(meta, dict) else {}
    rank, sn = _int(header.get("rank")), _int(perf.get("coll_sn"))
    if rank is None or sn is None:
        return None
    ts_us = _float(meta.get("dump_timestamp_us"))
    return {
        "ts": ts_us / 1e6 if ts_us else now,
        "job": job,
        "rank": rank,
        "node": str(meta["hostname"]) if meta.get("hostname") is not None else None,
        "gpu": None,
        "comm_id": str(header.get("id")) if header.get("id") is not None else None,
        "n_ranks": _int(header.get("n_ranks")),
        "coll": str(perf.get("coll")) if perf.get("coll") is not None else None,
        "coll_sn": sn,
        "msg_size_bytes": _int(perf.get("coll_msg_size_bytes")),
        "exec_time_us": _float(perf.get("coll_exec_time_us")),
        "busbw_gbs": _float(perf.get("coll_busbw_gbs")),
    }


def _object_end(text: str, j: int) -> int:
    """Index after the top-level object starting at `j` (braces outside strings), or -1 if the
    text ends first."""
    depth, in_str, esc = 0, False, False
    for k in range(j, len(text)):
        ch = text[k]
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return k + 1
    return -1


def iter_json_objects(text: str, max_pending: int = 1 << 20) -> Iterator[tuple[Any, int]]:
    """Top-level JSON objects one after another (one per line or pretty-printed), with the offset
    after each; stops before an object still being written. Garbage is skipped a line at a time
    (yielded as None)."""
    i, n = 0, len(text)
    while i < n:
        j = text.find("{", i)
        if j < 0:
            return
        end = _object_end(text, j)
        if end < 0:
            if n - j <= max_pending:
                return  # maybe still being written: read it again next time
            k = text.find("\n", j)
            i = n if k < 0 else k + 1
            yield None, i
            continue
        try:
            obj = json.loads(text[j:end])
        except (json.JSONDecodeError, RecursionError):
            obj = None
        i = end
        yield obj, i


def prom_records(text: str, job: str | None, now: float) -> tuple[list[dict], int]:
    """Rows from one Prometheus textfile snapshot, and how many samples were unusable."""
    by_key: dict[tuple, dict] = {}
    bad = 0
    try:
        families = list(text_string_to_metric_families(text))
    except (ValueError, TypeError, IndexError):
        return [], 1
    for fam in families:
        for s in fam.samples:
            lb = s.labels
            rank, sn = _int(lb.get("rank")), _int(lb.get("coll_sn"))
            if rank is None or sn is None:
                bad += 1
                continue
            key = (lb.get("comm_id"), rank, sn)
            row = by_key.setdefault(
                key,
                {
                    "ts": now,
                    "job": job if job is not None else (lb.get("slurm_job_id") if lb.get("slurm_job_id") not in (None, "unknown") else None),
                    "rank": rank,
                    "node": lb.get("hostname"),
                    "gpu": _int(_GPU.search(lb.get("gpu_device_id", "")).group(1)) if _GPU.search(lb.get("gpu_device_id", "")) else None,
                    "comm_id": lb.get("comm_id"),
                    "n_ranks": _int(lb.get("nranks", lb.get("n_ranks"))),
                    "coll": lb.get("collective"),
                    "coll_sn": sn,
                    "msg_size_bytes": _size(lb.get("message_size")),
                    "exec_time_us": None,
                    "busbw_gbs": None,
                },
            )
            if s.name == "nccl_collective_exec_time_microseconds":
                row["exec_time_us"] = _float(s.value)
            elif s.name == "nccl_bus_bandwidth_gbs":
                row["busbw_gbs"] = _float(s.value)
    return list(by_key.values()), bad


class NcclInspectorCollector:
    """Reads `<root>/<job>/**` Inspector output (JSON lines and `.prom` textfiles)."""

    name = "nccl_inspector"
    streams = STREAMS

    def __init__(self, root: str | Path, *, job: str | None = None):
        self.root = Path(root)
        self.job = job
        self.errors = 0
        # The shared tail (collectors/tail.py) per JSON file: a dump replaced or rotated is read
        # from its start, not from the old file's offset; pretty-printed objects wait in `_buf`.
        self._tails: dict[Path, FileTail] = {}
        self._buf: dict[Path, str] = {}
        self._prom_mtime: dict[Path, int] = {}

    def _job_of(self, path: Path) -> str | None:
        if self.job is not None:
            return self.job
        try:
            rel = path.relative_to(self.root)
        except ValueError:
            return None
        return rel.parts[0] if len(rel.parts) > 1 else None

    def collect(self, now: float) -> dict[str, pl.DataFrame]:
        rows: list[dict] = []
        if not self.root.exists():
            return {}
        files = [self.root] if self.root.is_file() else sorted(p for p in self.root.rglob("*") if p.is_file())
        for path in files:
            job = self._job_of(path)
            try:
                if path.suffix == ".prom":
                    mtime = path.stat().st_mtime_ns
                    if self._prom_mtime.get(path) == mtime:
                        continue
                    self._prom_mtime[path] = mtime
                    got, bad = prom_records(path.read_text(errors="replace")[:MAX_READ_BYTES], job, now)
                    rows += got
                    self.errors += bad
                    continue
                tail = self._tails.get(path)
                if tail is None:
                    tail = self._tails[path] = FileTail(path, from_start=True, max_read_bytes=MAX_READ_BYTES, max_line_bytes=MAX_READ_BYTES)
                lines = tail.read_lines()
            except OSError:
                self.errors += 1
                continue
            if not lines:
                continue
            chunk = self._buf.pop(path, "") + "\n".join(lines) + "\n"
            used = 0
            for obj, end in iter_json_objects(chunk):
                used = end
                row = json_record(obj, job, now) if obj is not None else None
                if row is None:
                    self.errors += 1
                    continue
                rows.append(row)
            rest = chunk[used:]
            if "{" in rest:  # an object still being written
                self._buf[path] = rest
        present = set(files)
        for gone in [p for p in self._tails if p not in present]:
            self._tails.pop(gone).close()  # deleted: release its handle
            self._buf.pop(gone, None)
        if not rows:
            return {}
        return {"collective_progress": schemas.frame(rows, schemas.COLLECTIVE_PROGRESS)}
