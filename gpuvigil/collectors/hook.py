"""Collector for the in-process hook (`gpuvigil.hook.instrument`): tails the per-rank JSON-lines files
a `FileSink` writes, and accepts the records an `HttpSink` POSTs (`HookReceiver`, or `push()` from
any web framework). Emits RANK_PROGRESS (one row per rank and process group) and ALLOCATOR_STATS.

The records come from training processes, so they are untrusted input: a line that is not a
valid record is dropped and counted in `errors`, never raised.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import polars as pl

from gpuvigil import schemas
from gpuvigil.collectors.tail import TailSet

STREAMS: Mapping[str, pl.Schema] = {"rank_progress": schemas.RANK_PROGRESS, "allocator_stats": schemas.ALLOCATOR_STATS}
MAX_LINE_BYTES = 1 << 20
MAX_READ_BYTES = 64 << 20  # per file per collect: a runaway writer cannot stall the pipeline


def _int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    return None


def _float(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def rows_from_record(record: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(rank_progress rows, allocator_stats rows) of one hook record; ValueError if it is not one."""
    if not isinstance(record, dict) or _float(record.get("ts")) is None or _int(record.get("rank")) is None:
        raise ValueError("not a hook record (needs numeric ts and rank)")
    base = {"ts": float(record["ts"]), "job": _str(record.get("job")), "rank": _int(record["rank"]), "node": _str(record.get("node")), "gpu": _int(record.get("gpu"))}
    progress_base = {**base, "step": _int(record.get("step")), "step_time_seconds": _float(record.get("step_time_seconds"))}
    progress = []
    pg_status = record.get("pg_status")
    if isinstance(pg_status, dict) and pg_status:
        for pg, st in pg_status.items():
            st = st if isinstance(st, dict) else {}
            progress.append(
                {
                    **progress_base,
                    "pg": str(pg),
                    "last_enqueued_seq": _int(st.get("last_enqueued")),
                    "last_started_seq": _int(st.get("last_started")),
                    "last_completed_seq": _int(st.get("last_completed")),
                    "current_op": _str(st.get("current_op")),
                }
            )
    else:
        progress.append(progress_base)
    allocator = []
    memory = record.get("memory")
    if isinstance(memory, dict) and _int(memory.get("allocated_bytes.all.current")) is not None and _int(memory.get("reserved_bytes.all.current")) is not None:
        reserved = _int(memory["reserved_bytes.all.current"])
        total, free = _int(memory.get("device_total_bytes")), _int(memory.get("device_free_bytes"))
        # What the device has in use beyond this process's reservations: other processes (and
        # this process's CUDA context, a few hundred MB).
        foreign = max(0, total - free - reserved) if total is not None and free is not None and reserved is not None else None
        allocator.append(
            {
                **base,
                "allocated_bytes": _int(memory["allocated_bytes.all.current"]),
                "reserved_bytes": reserved,
                "inactive_split_bytes": _int(memory.get("inactive_split_bytes.all.current")),
                "largest_free_block_bytes": None,
                "peak_allocated_bytes": _int(memory.get("allocated_bytes.all.peak")),
                "alloc_retries": _int(memory.get("num_alloc_retries")),
                "oom_count": _int(memory.get("num_ooms")),
                "device_capacity_bytes": total,
                "foreign_used_bytes": foreign,
            }
        )
    return progress, allocator


class HookCollector:
    """Tails `<dir>/*.jsonl` (and any explicit files) and drains pushed records on `collect()`."""

    name = "hook"
    streams = STREAMS

    def __init__(self, paths: Iterable[str | Path] = (), *, from_start: bool = True, max_read_bytes: int = MAX_READ_BYTES):
        self.paths = [Path(p) for p in paths]
        self.from_start = from_start
        self.errors = 0
        self.records = 0
        # The shared tail (collectors/tail.py): follows rotation and replacement of a rank's file.
        self._tails = TailSet(self.paths, from_start=from_start, suffixes=(".jsonl",), max_read_bytes=max_read_bytes, max_line_bytes=MAX_LINE_BYTES)
        self._dropped_seen = 0
        self.last_error: str | None = None
        self._pushed: list[Any] = []
        self._lock = threading.Lock()

    def push(self, record: Any) -> None:
        """Accept a record (or a list of records) POSTed by an HttpSink; thread-safe."""
        with self._lock:
            if isinstance(record, list):
                self._pushed.extend(record)
            else:
                self._pushed.append(record)

    def health(self) -> dict[str, str | None]:
        """One target, the hook's files: the latest read's first unreadable file, if any."""
        return {self.name: self.last_error}

    def _read_new(self) -> list[bytes]:
        try:
            lines = [line for _path, chunk in self._tails.read() for line in chunk if line.strip()]
        except OSError:
            self.errors += 1
            return []
        self.errors += len(self._tails.failures)
        self.last_error = next(iter(self._tails.failures.values()), None)
        dropped = self._tails.dropped_lines
        self.errors += max(0, dropped - self._dropped_seen)  # over-long lines were dropped
        self._dropped_seen = dropped
        return lines

    def collect(self, now: float) -> dict[str, pl.DataFrame]:
        records: list[Any] = []
        for line in self._read_new():
            try:
                records.append(json.loads(line))
            except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
                self.errors += 1
        with self._lock:
            records.extend(self._pushed)
            self._pushed = []
        progress: list[dict[str, Any]] = []
        allocator: list[dict[str, Any]] = []
        for record in records:
            try:
                p, a = rows_from_record(record)
            except ValueError:
                self.errors += 1
                continue
            self.records += 1
            progress.extend(p)
            allocator.extend(a)
        out = {}
        if progress:
            out["rank_progress"] = schemas.frame(progress, schemas.RANK_PROGRESS)
        if allocator:
            out["allocator_stats"] = schemas.frame(allocator, schemas.ALLOCATOR_STATS)
        return out


class HookReceiver:
    """A small HTTP endpoint for HttpSink: POST a record (or a list) as JSON to `/v1/hook`.
    Binds 127.0.0.1 unless told otherwise; port 0 picks a free port (see `url`)."""

    MAX_BODY = 4 << 20

    def __init__(self, collector: HookCollector, host: str = "127.0.0.1", port: int = 0):
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                if self.path.rstrip("/") != "/v1/hook":
                    self.send_error(404, "POST records to /v1/hook")
                    return
                length = int(self.headers.get("Content-Length") or 0)
                if length <= 0 or length > receiver.MAX_BODY:
                    self.send_error(413 if length > 0 else 411, "body missing or too large")
                    return
                try:
                    body = json.loads(self.rfile.read(length))
                except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
                    collector.errors += 1
                    self.send_error(400, "body is not JSON")
                    return
                collector.push(body)
                self.send_response(204)
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet
                pass

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        self._thread = threading.Thread(target=self.server.serve_forever, name="gpuvigil-hook-receiver", daemon=True)

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}/v1/hook"

    def start(self) -> HookReceiver:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> HookReceiver:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
