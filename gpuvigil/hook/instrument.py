"""In-process hook for PyTorch training loops.

    import gpuvigil.hook.instrument as gv
    hook = gv.start(job="llama-70b", sink=gv.FileSink("/var/run/gpuvigil"))  # or gv.HttpSink(url)
    for batch in data:
        ...
        hook.step()          # once per step; or hook.start_background(interval=1.0)

About once a second (`interval`) it publishes one JSON record per rank: the step count and the
last step's duration, the caching allocator's state (`torch.cuda.memory_stats()` and free/total
device memory, when CUDA is in use) and the Flight Recorder's `pg_status` (last enqueued /
started / completed collective per process group, when torch.distributed is in use). A
`FileSink` appends JSON lines to one file per rank, which the node agent tails
(`gpuvigil.collectors.hook.HookCollector`); an `HttpSink` POSTs them to the collector from a
background thread so that a slow collector never slows training.

Collective starts. To name a rank stuck inside a kernel, whose collective is enqueued like its
peers' (CUDA is asynchronous), the hang detector needs each rank's last *started* collective
(`pg_status.last_started_collective`). PyTorch records it only when collective timing is on:

- `ProcessGroupNCCL::WorkNCCL::startedGPUExecutionInternal()` (torch/csrc/distributed/c10d/
  ProcessGroupNCCL.cpp) begins "if timing is disabled we won't have allocated start events /
  if (!timingEnabled_) return false", and the watchdog moves `pgStatus_->lastStartedSeq` (what
  the Flight Recorder's `getPgStatus()` dumps as `last_started_collective`, FlightRecorderDetail.hpp)
  only for a work that `isStarted()`: without timing it stays -1;
- the variable is read once, when a process group is built: the `ProcessGroupNCCL`
  constructor does `enableTiming_.store(getCvarBool(TORCH_NCCL_ENABLE_TIMING, false) ||
  desyncDebug)` (ProcessGroupNCCL.hpp: `TORCH_NCCL_ENABLE_TIMING`, also `NCCL_ENABLE_TIMING`);
- a group that exists can be switched on at run time: `ProcessGroup._enable_collectives_timing()`
  (ProcessGroup.hpp `enableCollectivesTiming()`, which `ProcessGroupNCCL::enableCollectivesTiming()`
  implements as `enableTiming_.store(true)`; `initWork(...)` passes `enableTiming_.load()` to each
  new work, so collectives enqueued afterwards get start events). torch 2.13 has it; a release
  or backend without it raises ("is missing implementation of enableCollectivesTiming");
- the cost: one more CUDA event recorded on the NCCL stream per collective and queried by the
  watchdog; PyTorch's own note on the variable warns that the event queries "can increase
  chances of a watchdog hang" (ProcessGroupNCCL.hpp). It also fills the Flight Recorder's
  per-collective `duration_ms`;
- gloo records no starts: on a real gloo group (torch 2.13 CPU, tested), `last_started_collective`
  stays -1 with the variable set and with the runtime switch.

So `start()` turns timing on: called before `init_process_group` (the documented use: at the top
of the script) it sets TORCH_NCCL_ENABLE_TIMING=1 unless the user set it; called after, it also
uses the runtime switch on every existing group, and where there is none it logs once how to
fix it. Opt out with `start(..., collective_timing=False)` or GPUVIGIL_COLLECTIVE_TIMING=0. Each
record then says `collective_starts` (true: NCCL with timing on) and, where starts are not
recorded (gloo, timing off or switched on too late), sends `last_started` as null, so that a -1
("nothing started yet") is never read as "stuck before its collective".

This was checked against PyTorch's source and a real gloo group on CPU; no GPU was at hand, so
the NCCL behaviour above is the source's, not a measurement.

Only the standard library is imported, on every path (tested: no polars, numpy, pydantic or
scikit-learn in `sys.modules` after publishing Flight Recorder state): torch is used only if the
training process already imported it, so the package does not require torch, and the Flight
Recorder is read through torch's JSON dump. `step()` costs a clock read and a
comparison; the publishing (a few dozen microseconds without collectives in flight) happens once
per interval. See `gpuvigil bench hook` for measured overhead.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import queue
import re
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, Protocol

RECORD_VERSION = 1
TIMING_ENV = "TORCH_NCCL_ENABLE_TIMING"
OPT_OUT_ENV = "GPUVIGIL_COLLECTIVE_TIMING"  # "0": leave collective timing as the job set it
_ON = {"1", "true", "yes", "y", "on"}
_late_start_logged = False
# The memory_stats keys the collector uses (the full dict has ~150 keys: no need to ship them).
MEMORY_KEYS = (
    "allocated_bytes.all.current",
    "allocated_bytes.all.peak",
    "reserved_bytes.all.current",
    "inactive_split_bytes.all.current",
    "inactive_split.all.current",
    "num_alloc_retries",
    "num_ooms",
)


class Sink(Protocol):
    def write(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def _safe_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", text) or "job"


class FileSink:
    """One JSON-lines file per rank in `directory` (created if needed): `<job>.rank<N>.jsonl`."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self._fh = None
        self.path: Path | None = None

    def open_for(self, job: str, rank: int) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self.path = self.directory / f"{_safe_name(job)}.rank{rank}.jsonl"
        self._fh = self.path.open("a", buffering=1, encoding="utf-8")  # line-buffered: a tailer sees whole lines

    def write(self, record: dict[str, Any]) -> None:
        if self._fh is None:
            self.open_for(str(record.get("job")), int(record.get("rank") or 0))
        self._fh.write(json.dumps(record, separators=(",", ":")) + "\n")

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


class HttpSink:
    """POSTs each record as JSON to `url` from a background thread; when the collector is slow or
    down, records queue up to `max_queue` and then the oldest are dropped (counted in `dropped`)."""

    def __init__(self, url: str, *, timeout: float = 2.0, max_queue: int = 600):
        self.url = url
        self.timeout = timeout
        self.sent = 0
        self.failed = 0
        self.dropped = 0
        self.last_error: str | None = None
        self._pending = 0  # written but not yet sent or failed
        self._pending_lock = threading.Lock()
        self._queue: queue.Queue[dict[str, Any] | None] = queue.Queue(maxsize=max_queue)
        self._thread = threading.Thread(target=self._run, name="gpuvigil-hook-http", daemon=True)
        self._thread.start()

    def write(self, record: dict[str, Any]) -> None:
        with self._pending_lock:
            self._pending += 1
        while True:
            try:
                self._queue.put_nowait(record)
                return
            except queue.Full:
                try:
                    self._queue.get_nowait()
                    self.dropped += 1
                    with self._pending_lock:
                        self._pending -= 1
                except queue.Empty:
                    pass

    def _run(self) -> None:
        # Imported here, not at module level: urllib.request pulls in http.client, email and ssl
        # (~10 MB, ~15 ms), which a FileSink hook never needs.
        import urllib.error
        import urllib.request

        while True:
            record = self._queue.get()
            if record is None:
                return
            body = json.dumps(record, separators=(",", ":")).encode()
            request = urllib.request.Request(self.url, data=body, headers={"Content-Type": "application/json"}, method="POST")
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    response.read()
                self.sent += 1
            except (urllib.error.URLError, OSError, ValueError) as exc:
                self.failed += 1
                self.last_error = str(exc)
            finally:
                with self._pending_lock:
                    self._pending -= 1

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every written record was sent or failed; True if that happened in time."""
        deadline = time.monotonic() + timeout
        while self._pending > 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        return self._pending == 0

    def close(self) -> None:
        self.flush()
        try:
            self._queue.put(None, timeout=1.0)
        except queue.Full:
            return
        self._thread.join(timeout=self.timeout + 1)


def _env_int(*names: str) -> int | None:
    for name in names:
        value = os.environ.get(name)
        if value is not None and value.strip().lstrip("-").isdigit():
            return int(value)
    return None


def _env_on(name: str) -> bool | None:
    value = os.environ.get(name)
    return None if value is None else value.strip().lower() in _ON


def _torch_timing_env() -> bool:
    """Whether the variables a process group reads at construction turn its start events on
    (desync debugging implies timing: `getCvarBool(TORCH_NCCL_ENABLE_TIMING) || desyncDebug`)."""
    return bool(_env_on(TIMING_ENV) or _env_on("TORCH_NCCL_DESYNC_DEBUG") or os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL")


def _process_groups(dist: Any) -> list[Any]:
    world = getattr(getattr(dist, "distributed_c10d", None), "_world", None)
    pg_map = getattr(world, "pg_map", None)
    if isinstance(pg_map, dict) and pg_map:
        return list(pg_map)
    default = getattr(getattr(dist, "group", None), "WORLD", None)
    return [default] if default is not None else []


def _distributed_live(torch: Any) -> Any:
    dist = getattr(torch, "distributed", None) if torch is not None else None
    try:
        return dist if dist is not None and dist.is_available() and dist.is_initialized() else None
    except Exception:  # noqa: BLE001 - a half-imported torch must not break the caller
        return None


def enable_collective_timing(enabled: bool | None = None) -> str:
    """Turn on the start records a hang's culprit stuck in a kernel is named from (see the module
    docstring); returns how: `before_group` (set before any process group was built, or the
    job's own TORCH_NCCL_ENABLE_TIMING), `runtime` (switched on every existing group),
    `too_late` (groups exist and cannot be switched: their starts are unknown), `user_off`
    (the job set TORCH_NCCL_ENABLE_TIMING=0) or `opted_out`."""
    global _late_start_logged
    if enabled is None:
        enabled = _env_on(OPT_OUT_ENV) is not False
    if not enabled:
        return "opted_out"
    user = _env_on(TIMING_ENV)
    if user is False:
        return "user_off"
    if user is None:
        os.environ[TIMING_ENV] = "1"  # for every group built from now on
    dist = _distributed_live(_torch())
    if dist is None or user:
        return "before_group"
    groups = _process_groups(dist)
    switched = 0
    for group in groups:
        switch = getattr(group, "_enable_collectives_timing", None)
        if switch is None:
            continue
        try:
            switch()
            switched += 1
        except Exception:  # noqa: BLE001 - a backend without the switch keeps its starts unknown
            pass
    if groups and switched == len(groups):
        return "runtime"
    try:
        nccl = "nccl" in str(dist.get_backend()).lower()
    except Exception:  # noqa: BLE001 - cannot tell: say it
        nccl = True
    if nccl and not _late_start_logged:  # (gloo records no starts, however timing is set)
        _late_start_logged = True
        import logging

        logging.getLogger("gpuvigil.hook").warning(
            "gpuvigil: the process group was created before gpuvigil.hook.instrument.start() and this torch cannot turn on "
            "collective timing at run time, so a rank stuck inside a kernel cannot be named. Call start() before "
            "torch.distributed.init_process_group(), or set %s=1 in the job's environment.", TIMING_ENV)
    return "too_late"


def _torch() -> Any:
    # Never import torch for a process that does not use it already (the hook must stay cheap and
    # the package must not require torch).
    return sys.modules.get("torch")


class Hook:
    """Publishes one rank's progress, allocator state and collective progress to a sink."""

    def __init__(self, job: str, sink: Sink, *, rank: int | None = None, node: str | None = None, gpu: int | None = None,
                 interval: float = 1.0, clock=time.perf_counter, collective_timing: str | None = None):
        if interval <= 0:
            raise ValueError("interval must be positive")
        self.job = job
        self.sink = sink
        self.rank = rank if rank is not None else (_env_int("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK") or 0)
        self.node = node or socket.gethostname()
        self.gpu = gpu if gpu is not None else _env_int("LOCAL_RANK", "SLURM_LOCALID")
        self.interval = interval
        self.clock = clock
        self.step_count = 0
        self.last_step_seconds: float | None = None
        self._last_step_at: float | None = None
        self._next_publish = clock() + interval
        self._steps_in_window = 0
        self._window_step_seconds = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._in_flight: dict[str, int] = {}  # pg → in-flight seq seen at the previous publish
        # How start() set collective timing (enable_collective_timing); None: not through start().
        self.collective_timing = collective_timing
        self._starts: bool | None = None
        self.published = 0
        self.errors = 0
        self.last_error: str | None = None
        if hasattr(sink, "open_for"):
            try:
                sink.open_for(job, self.rank)
            except OSError as exc:  # e.g. a read-only folder: keep training, retry on each publish
                self.errors += 1
                self.last_error = f"{type(exc).__name__}: {exc}"

    # -- the training loop's side -------------------------------------------------------

    def step(self) -> None:
        """Mark the end of one training step; publishes when the interval has passed."""
        now = self.clock()
        with self._lock:
            if self._last_step_at is not None:
                self.last_step_seconds = now - self._last_step_at
                self._steps_in_window += 1
                self._window_step_seconds += self.last_step_seconds
            self._last_step_at = now
            self.step_count += 1
            due = self._thread is None and now >= self._next_publish
        if due:
            self.publish()

    def start_background(self, interval: float | None = None) -> Hook:
        """Publish from a daemon thread instead of from `step()` (which then only counts)."""
        if interval is not None:
            if interval <= 0:
                raise ValueError("interval must be positive")
            self.interval = interval
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._background, name="gpuvigil-hook", daemon=True)
            self._thread.start()
        return self

    def _background(self) -> None:
        while not self._stop.wait(self.interval):
            self.publish()

    def stop(self) -> None:
        """Publish a last record, stop the background thread and close the sink."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval + 5)
            self._thread = None
        self.publish()
        self.sink.close()

    def __enter__(self) -> Hook:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- publishing ----------------------------------------------------------------------

    def record(self) -> dict[str, Any]:
        """The record that `publish()` sends now."""
        with self._lock:
            steps = self._steps_in_window
            mean = self._window_step_seconds / steps if steps else None
            self._steps_in_window = 0
            self._window_step_seconds = 0.0
            record: dict[str, Any] = {
                "v": RECORD_VERSION,
                "ts": time.time(),
                "job": self.job,
                "rank": self.rank,
                "node": self.node,
                "gpu": self.gpu,
                "step": self.step_count,
                "step_time_seconds": self.last_step_seconds,
                "mean_step_time_seconds": mean,
                "steps_in_interval": steps,
            }
        torch = _torch()
        if torch is not None:
            record["memory"] = self._memory(torch)
            record["pg_status"] = self._pg_status(torch)
            if record["pg_status"] is not None and self._starts is not None:
                record["collective_starts"] = self._starts
        return record

    def publish(self) -> None:
        try:
            record = self.record()
            self.sink.write(record)
            self.published += 1
        except Exception as exc:  # noqa: BLE001 - monitoring must never take the training job down
            self.errors += 1
            self.last_error = f"{type(exc).__name__}: {exc}"
        finally:
            self._next_publish = self.clock() + self.interval

    def _collective_starts(self, distributed: Any) -> bool | None:
        """Whether the Flight Recorder records this job's collective starts: only NCCL's start
        events do, and only with timing on. None: cannot tell (no backend name)."""
        if self._starts is None:
            try:
                backend = str(distributed.get_backend()).lower()
            except Exception:  # noqa: BLE001 - a stand-in or a torch without get_backend
                return None
            if "nccl" not in backend:
                self._starts = False
            elif self.collective_timing in ("before_group", "runtime"):
                self._starts = True
            else:
                self._starts = self.collective_timing != "too_late" and _torch_timing_env()
        return self._starts

    def _memory(self, torch: Any) -> dict[str, int] | None:
        cuda = getattr(torch, "cuda", None)
        if cuda is None or not cuda.is_initialized():
            return None  # do not create a CUDA context for a process that has none
        device = cuda.current_device()
        stats = cuda.memory_stats(device)
        out = {k: int(stats[k]) for k in MEMORY_KEYS if k in stats}
        free, total = cuda.mem_get_info(device)
        out["device_free_bytes"], out["device_total_bytes"] = int(free), int(total)
        if self.gpu is None:
            self.gpu = int(device)
        return out

    def _pg_status(self, torch: Any) -> dict[str, dict[str, Any]] | None:
        distributed = getattr(torch, "distributed", None)
        if distributed is None or not distributed.is_available() or not distributed.is_initialized():
            return None
        dump = _fr_dumper(getattr(getattr(torch, "_C", None), "_distributed_c10d", None))
        if dump is None:
            return None
        # Without entries the dump is a few microseconds; entries (tens of ms for a full buffer)
        # are fetched only when a collective has stayed in flight for a whole interval.
        status = dump(False).get("pg_status") or {}
        starts = self._collective_starts(distributed)
        out: dict[str, dict[str, Any]] = {}
        stuck = []
        for pg, st in status.items():
            enqueued, completed = int(st.get("last_enqueued_collective", -1)), int(st.get("last_completed_collective", -1))
            started = None if starts is False else int(st.get("last_started_collective", -1))
            out[pg] = {"last_enqueued": enqueued, "last_started": started, "last_completed": completed, "current_op": None}
            if enqueued > completed:
                if self._in_flight.get(pg) == enqueued:
                    stuck.append(pg)
                self._in_flight[pg] = enqueued
            else:
                self._in_flight.pop(pg, None)
        if stuck:
            for entry in dump(True).get("entries") or []:
                pg = str((entry.get("process_group") or ("",))[0])
                if pg in stuck and int(entry.get("collective_seq_id", -1)) == out[pg]["last_completed"] + 1:
                    out[pg]["current_op"] = str(entry.get("profiling_name", "")).split(":", 1)[-1] or None
        return out


class _NoGlobalsUnpickler(pickle.Unpickler):
    """The Flight Recorder's pickle is plain containers and scalars; anything naming a global is
    refused. (The full restricted unpickler, `gpuvigil.collectors.safe_pickle`, is for dumps read
    from disk; importing it here would load the collectors package, and polars with it.)"""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"global {module}.{name} refused")


def _fr_dumper(c10d: Any):
    """`dump(with_entries) -> dict` over the Flight Recorder of this process, or None.

    torch's JSON dump is preferred (json is already loaded; no pickle at all); torch releases
    without it have the pickle dump, under `_dump_fr_trace` (every backend) or the older
    NCCL-only `_dump_nccl_trace`."""
    if c10d is None:
        return None
    as_json = getattr(c10d, "_dump_fr_trace_json", None) or getattr(c10d, "_dump_nccl_trace_json", None)
    if as_json is not None:
        def dump(with_entries: bool) -> dict[str, Any]:
            kwargs = {"includeCollectives": True, "onlyActive": True} if with_entries else {"includeCollectives": False}
            data = json.loads(as_json(**kwargs))
            return data if isinstance(data, dict) else {}

        return dump
    as_pickle = getattr(c10d, "_dump_fr_trace", None) or getattr(c10d, "_dump_nccl_trace", None)
    if as_pickle is None:
        return None

    def dump_pickle(with_entries: bool) -> dict[str, Any]:
        kwargs = {"includeCollectives": True, "includeStackTraces": False, "onlyActive": True} if with_entries else {"includeCollectives": False}
        data = _NoGlobalsUnpickler(io.BytesIO(as_pickle(**kwargs))).load()
        return data if isinstance(data, dict) else {}

    return dump_pickle


def start(job: str, sink: Sink | str | Path, *, rank: int | None = None, node: str | None = None, gpu: int | None = None,
          interval: float = 1.0, collective_timing: bool | None = None) -> Hook:
    """Create a hook for this rank. `sink` may be a FileSink/HttpSink, a folder, or an http(s) URL.

    Call it before `torch.distributed.init_process_group()`: it turns on NCCL's collective start
    records (TORCH_NCCL_ENABLE_TIMING=1, see the module docstring), which name a rank stuck in a
    kernel. `collective_timing=False` (or GPUVIGIL_COLLECTIVE_TIMING=0) leaves timing as it is."""
    if isinstance(sink, (str, Path)):
        text = str(sink)
        sink = HttpSink(text) if text.startswith(("http://", "https://")) else FileSink(text)
    timing = enable_collective_timing(collective_timing)
    return Hook(job, sink, rank=rank, node=node, gpu=gpu, interval=interval, collective_timing=timing)
