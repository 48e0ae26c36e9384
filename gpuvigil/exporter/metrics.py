"""One scrape-time snapshot of a gpuvigil runtime as metric families, for every exporter.

Prometheus (`exporter/prometheus.py`) and OpenTelemetry (`exporter/otel.py`) both render the
families built here, so the two exports always carry the same names, units and labels.

Naming follows Prometheus conventions: `gpuvigil_` prefix, base units in the name (`_bytes`,
`_seconds`, `_watts`, `_celsius`, `_hertz`, `_ratio`), counters end in `_total`. Label sets are
bounded: per-GPU series carry (node, gpu); per-rank series (job, rank) are bounded by the ranks
of running jobs; where a rank runs, its GPU UUID, process group and tenant are on `_info` series
so they do not multiply every other series.

Note on the `job` label: it is the training job. Scrape gpuvigil with `honor_labels: true` so
Prometheus keeps it instead of renaming it `exported_job` (see alerts/prometheus-scrape.yml).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import polars as pl

import gpuvigil
from gpuvigil import signals
from gpuvigil.gpu import throttle, xid
from gpuvigil.model import Finding, FindingKind, Severity

MetricType = Literal["gauge", "counter", "info", "histogram"]
Labels = tuple[tuple[str, str], ...]

# NVML clock-event (throttle) reasons that mean lost speed, a series each (idle, app-clock and
# sync-boost reasons are normal operation); the raw bitmask is exported as well.
THROTTLE_REASONS: dict[str, int] = {r.name: r.bit for r in throttle.REASONS if r.slows}
NODE_STATES = ("up", "cordoned", "draining", "drained", "down")
JOB_STATES = ("pending", "running", "preempted", "requeued", "completed", "failed")
# Buckets for the scheduler's queue wait (seconds): 10 s .. 1 day.
WAIT_BUCKETS = (10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0, 7200.0, 21600.0, 86400.0)
# Buckets for tick and detector latency (seconds).
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
# Evidence keys a detector may use for its time-to-OOM estimate, most specific first.
TIME_TO_OOM_KEYS = ("time_to_oom_seconds", "seconds_to_oom", "eta_seconds", "predicted_seconds_to_oom")


@dataclass
class Family:
    """One metric family: name (without `_total`/`_info` suffix), type, help, samples."""

    name: str
    type: MetricType
    help: str
    unit: str = ""
    samples: list[tuple[Labels, float]] = field(default_factory=list)
    # histogram only: label set → (bucket upper bounds, cumulative counts, sum, count)
    histograms: list[tuple[Labels, tuple[float, ...], list[int], float, int]] = field(default_factory=list)
    buckets: tuple[float, ...] = ()  # histogram only: upper bounds (without +Inf)

    def add(self, value: float, **labels: Any) -> None:
        self.samples.append((tuple((k, "" if v is None else str(v)) for k, v in labels.items()), float(value)))


class RuntimeLike(Protocol):
    """What the exporters read (gpuvigil.app.runtime.Runtime satisfies it)."""

    pipeline: Any
    scheduler: Any
    now: float
    last_result: Any


class HistogramAcc:
    """A cumulative histogram per label set (thread-safe enough under the runtime lock)."""

    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.series: dict[Labels, tuple[list[int], list[float]]] = {}
        self.listeners: list[Callable[[float, Labels], None]] = []  # e.g. OTel histograms

    def observe(self, value: float, labels: Labels = ()) -> None:
        for listener in self.listeners:
            listener(value, labels)
        counts, total = self.series.setdefault(labels, ([0] * len(self.buckets), [0.0, 0.0]))
        for i, upper in enumerate(self.buckets):
            if value <= upper:
                counts[i] += 1
        total[0] += value
        total[1] += 1

    def family(self, name: str, help: str, unit: str = "") -> Family:
        fam = Family(name, "histogram", help, unit, buckets=self.buckets)
        for labels, (counts, total) in sorted(self.series.items()):
            fam.histograms.append((labels, self.buckets, list(counts), total[0], int(total[1])))
        return fam


class TickStats:
    """A pipeline sink that accumulates what a single scrape cannot see: per-tick latencies.

    Also tallies findings raised and scheduler actions incrementally (cursors into the
    append-only lists), so a scrape costs the same after a week as after a minute.
    """

    def __init__(self) -> None:
        self.tick_seconds = HistogramAcc(LATENCY_BUCKETS)
        self.detector_seconds = HistogramAcc(LATENCY_BUCKETS)
        self.ticks = 0
        self._finding_cursor = 0
        self.findings_by_kind: Counter[tuple[str, str]] = Counter()
        self._action_cursor = 0
        self.actions_by_kind: Counter[str] = Counter()
        self.preemptions: Counter[tuple[str, str]] = Counter()
        self.requeues: Counter[tuple[str, str]] = Counter()
        self.waits = HistogramAcc(WAIT_BUCKETS)
        self._requeued_at: dict[str, float] = {}

    def on_tick(self, result: Any, window: Any) -> None:
        self.ticks += 1
        self.tick_seconds.observe(result.duration_seconds)
        for detector, seconds in result.detector_seconds.items():
            self.detector_seconds.observe(seconds, (("detector", detector),))

    def catch_up(self, runtime: RuntimeLike) -> None:
        """Fold in findings and scheduler actions appended since the last call."""
        findings = runtime.pipeline.all_findings
        for f in findings.since(self._finding_cursor):
            self.findings_by_kind[(f.kind.value, f.severity.value)] += 1
        self._finding_cursor = findings.total
        sched = runtime.scheduler
        actions = sched.actions
        for a in actions.since(self._action_cursor):
            self.actions_by_kind[a.action] += 1
            js = sched.jobs.get(a.job) if a.job else None
            if js is None:
                continue
            key = (js.spec.priority, js.spec.tenant)
            if a.action in ("requeued", "preempted"):
                (self.preemptions if a.action == "preempted" else self.requeues)[key] += 1
                self._requeued_at[a.job] = a.ts
            elif a.action == "placed":
                since = self._requeued_at.pop(a.job, js.spec.submit_ts)
                self.waits.observe(max(0.0, a.ts - since), (("priority", key[0]), ("tenant", key[1])))
        self._action_cursor = actions.total


def _rows(df: pl.DataFrame, cols: Iterable[str]) -> Iterable[tuple]:
    return zip(*(df[c].to_list() for c in cols), strict=True)


def time_to_oom_seconds(finding: Finding) -> float | None:
    for key in TIME_TO_OOM_KEYS:
        value = finding.evidence.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None


# Per-GPU series: (name, type, column of the latest GPU sample, help, scale). At 10,000 GPUs these
# are ~240,000 samples, most of a scrape, so they have two renderers: `Snapshot._gpu_families`
# (Family objects, for OTel and tests) and `gpu_exposition_text` (Prometheus text straight from the
# frame, for /metrics); tests/test_exporter.py checks that both give the same exposition.
# The table of telemetry columns (gpuvigil/signals.py) names each one's series, scale and help: a
# column with an exporter series there is exported here.
GPU_SPECS: list[tuple[str, MetricType, str, str, float]] = [
    (s.prometheus.removesuffix("_total") if s.prometheus.endswith("_total") else s.prometheus, "counter" if s.prometheus.endswith("_total") else "gauge",
     s.name, s.prometheus_help, s.prometheus_scale)
    for s in signals.GPU_SIGNALS
    if s.prometheus
]
GPU_THROTTLED = ("gpuvigil_gpu_clock_throttled", "gauge", "1 when the clock-event reason is active on the GPU.")
GPU_FATAL = ("gpuvigil_gpu_last_xid_fatal", "gauge", "1 when the GPU's most recent XID needs an operator (reset, reboot, drain) per the XID table.")
GPU_INFO = ("gpuvigil_gpu", "info", "GPU identity.")
# InfiniBand/RoCE ports, per (node, device, port): (name, type, ib_ports column, help, scale).
IB_SPECS: list[tuple[str, MetricType, str, str, float]] = [
    ("gpuvigil_ib_port_rate_bytes_per_second", "gauge", "rate_gbps", "Rate the port trained at (active width x speed; 400 Gb/s NDR is 5e10).", 1e9 / 8),
    ("gpuvigil_ib_port_width_lanes", "gauge", "width", "Active lanes of the port (1, 2, 4, 8, 12).", 1),
    ("gpuvigil_ib_port_link_downed", "counter", "link_downed", "Times the port's link training failed and the link went down.", 1),
    ("gpuvigil_ib_port_link_error_recovery", "counter", "link_error_recovery", "Times the link recovered from errors by retraining.", 1),
    ("gpuvigil_ib_port_symbol_errors", "counter", "symbol_error", "Minor link errors on the port's physical lanes.", 1),
    ("gpuvigil_ib_port_receive_errors", "counter", "port_rcv_errors", "Packets with an error received on the port.", 1),
    ("gpuvigil_ib_port_link_integrity_errors", "counter", "local_link_integrity_errors", "Times local physical errors exceeded their threshold.", 1),
    ("gpuvigil_ib_port_buffer_overrun_errors", "counter", "excessive_buffer_overrun_errors", "Input buffer overruns on the port.", 1),
    ("gpuvigil_ib_port_transmit_discards", "counter", "port_xmit_discards", "Outbound packets discarded because the port was down or congested.", 1),
    ("gpuvigil_ib_port_out_of_buffer", "counter", "out_of_buffer", "Packets dropped for lack of receive buffers (mlx5 hw_counters).", 1),
    ("gpuvigil_ib_port_local_ack_timeouts", "counter", "local_ack_timeout_err", "Transport retries after a missing ACK (mlx5 hw_counters; RoCE congestion or loss).", 1),
]
IB_UP = ("gpuvigil_ib_port_up", "gauge", "1 when the InfiniBand/RoCE port is ACTIVE.")
IB_PORTS = ("gpuvigil_ib_ports", "gauge", "InfiniBand/RoCE ports present on the node (sysfs).")
IB_INFO = ("gpuvigil_ib_port", "info", "An InfiniBand/RoCE port: link layer, PCI address, the GPUs it serves and how that is known.")
_THROTTLE_INDEX = [c for _, _, c, _, _ in GPU_SPECS].index("throttle_reasons")


def _with_fatal(latest: pl.DataFrame) -> pl.DataFrame:
    fatal_codes = sorted(code for code, row in xid.table().items() if row.fatal)
    return latest.with_columns(pl.col("last_xid").is_in(fatal_codes).fill_null(False).alias("_fatal"))


def _escape(value: str) -> str:
    # As prometheus_client escapes label values in the text format.
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r'\"')


def _help(name: str, typ: str, help: str) -> str:
    return f"# HELP {name} {help.replace(chr(92), chr(92) * 2).replace(chr(10), chr(92) + 'n')}\n# TYPE {name} {typ}\n"


def gpu_exposition_text(latest: pl.DataFrame) -> str:
    """The per-GPU families in the Prometheus text format, byte for byte what prometheus_client
    renders from `Snapshot._gpu_families`, written straight from the latest-sample frame (one
    f-string per sample instead of Sample objects, dicts and sorting: ~8x less CPU at 10k GPUs)."""
    from prometheus_client.utils import floatToGoString as num

    fams = [*GPU_SPECS]
    parts: list[str] = []
    rows = list(_rows(_with_fatal(latest), ["node", "gpu", "gpu_uuid", "_fatal", *[c for _, _, c, _, _ in fams]])) if latest.height else []
    # Labels sorted by name, as prometheus_client writes them: gpu, (gpu_uuid,) node, (reason).
    keys = [f'gpu="{_escape(str(r[1]))}",node="{_escape(str(r[0]))}"' for r in rows]
    for k, (name, typ, _col, help, scale) in enumerate(fams):
        mname = name + "_total" if typ == "counter" else name
        parts.append(_help(mname, typ, help))
        last_xid = fams[k][2] == "last_xid"
        for key, r in zip(keys, rows, strict=True):
            value = r[4 + k]
            if value is None:
                if not last_xid:
                    continue
                value = 0
            parts.append(f"{mname}{{{key}}} {num(float(value * scale))}\n")
    name, typ, help = GPU_THROTTLED
    parts.append(_help(name, typ, help))
    reasons = [(f',reason="{_escape(reason)}"}} ', bit) for reason, bit in THROTTLE_REASONS.items()]
    for key, r in zip(keys, rows, strict=True):
        mask = r[4 + _THROTTLE_INDEX]
        if mask is not None:
            for tail, bit in reasons:
                parts.append(f"{name}{{{key}{tail}{'1.0' if mask & bit else '0.0'}\n")
    name, typ, help = GPU_FATAL
    parts.append(_help(name, typ, help))
    for key, r in zip(keys, rows, strict=True):
        parts.append(f"{name}{{{key}}} {'1.0' if r[3] else '0.0'}\n")
    name, _typ, help = GPU_INFO
    parts.append(_help(name + "_info", "gauge", help))
    for r in rows:
        parts.append(f'{name}_info{{gpu="{_escape(str(r[1]))}",gpu_uuid="{_escape(str(r[2] or ""))}",node="{_escape(str(r[0]))}"}} 1.0\n')
    return "".join(parts)


class Snapshot:
    """Builds the metric families of a runtime; `families()` takes the runtime's lock itself, for
    the reads of mutable state only."""

    def __init__(self, runtime: RuntimeLike, stats: TickStats | None = None, *, team_of_tenant: Callable[[str], str] | None = None, extra: Iterable[Callable[[], Iterable[Family]]] = (), lock: threading.RLock | None = None):
        self.runtime = runtime
        self.stats = stats or TickStats()
        self.team_of_tenant = team_of_tenant or (lambda tenant: "")
        self.extra = list(extra)
        # Shared with the tick loop: a scrape never sees a half-applied tick.
        self.lock = lock or threading.RLock()

    # -- families ---------------------------------------------------------------------------
    def families(self) -> list[Family]:
        gpu_latest, out = self.parts()
        return out[:1] + self._gpu_families(gpu_latest) + out[1:]

    def parts(self) -> tuple[pl.DataFrame, list[Family]]:
        """(latest GPU sample per GPU, every other family): what needs the lock, taken under it.
        The per-GPU families are built from the frame, after the lock, by `_gpu_families` or, as
        exposition text directly, by `gpu_exposition_text`."""
        with self.lock:
            self.stats.catch_up(self.runtime)
            # Under the lock only what reads mutable runtime state. The per-GPU series (most of a
            # large scrape: ~240k samples at 10k GPUs) are built after it from the latest-sample
            # frame, an immutable copy, so the tick loop never waits on their Python loop.
            gpu_latest = self.runtime.pipeline.window.latest("gpu_samples", ["node", "gpu"])
            out: list[Family] = [self._build_info()]
            out += self._rank_families()
            out += self._job_families()
            out += self._finding_families()
            out += self._node_families()
            out += self._ib_families()
            out += self._scheduler_families()
            out += self._pipeline_families()
            for source in self.extra:
                out += list(source())
        return gpu_latest, out

    def _build_info(self) -> Family:
        fam = Family("gpuvigil_build", "info", "gpuvigil version.")
        fam.add(1, version=gpuvigil.__version__)
        return fam

    def _gpu_families(self, latest: pl.DataFrame) -> list[Family]:
        specs = GPU_SPECS
        fams = [Family(name, typ, help) for name, typ, _, help, _ in specs]
        throttled = Family(*GPU_THROTTLED)
        fatal = Family(*GPU_FATAL)
        info = Family(*GPU_INFO)
        if latest.height == 0:
            return [*fams, throttled, fatal, info]
        cols = ["node", "gpu", "gpu_uuid", "_fatal", *[col for _, _, col, _, _ in specs]]
        for row in _rows(_with_fatal(latest), cols):
            node, gpu, uuid, last_fatal, *values = row
            key: Labels = (("node", node), ("gpu", str(gpu)))  # built once per GPU, shared by its series
            for fam, (_, _, col, _, scale), value in zip(fams, specs, values, strict=True):
                if value is None:
                    if col == "last_xid":
                        value = 0
                    else:
                        continue
                fam.samples.append((key, float(value * scale)))
            mask = values[_THROTTLE_INDEX]
            if mask is not None:
                for reason, bit in THROTTLE_REASONS.items():
                    throttled.samples.append(((*key, ("reason", reason)), 1.0 if mask & bit else 0.0))
            fatal.samples.append((key, 1.0 if last_fatal else 0.0))
            info.add(1, node=node, gpu=gpu, gpu_uuid=uuid or "")
        return [*fams, throttled, fatal, info]

    def _running_ranks(self, stream: str) -> pl.DataFrame:
        """Latest row per (job, rank) of a stream, for jobs still running (bounded series)."""
        window = self.runtime.pipeline.window
        latest = window.latest(stream, ["job", "rank"])
        running = [name for name, js in self.runtime.scheduler.jobs.items() if js.state == "running"]
        if latest.height == 0:
            return latest
        return latest.filter(pl.col("job").is_in(running))

    def _rank_families(self) -> list[Family]:
        step_time = Family("gpuvigil_rank_step_time_seconds", "gauge", "Duration of the rank's last completed training step.")
        step = Family("gpuvigil_rank_step", "gauge", "Last training step the rank completed.")
        enq = Family("gpuvigil_rank_collective_enqueued_seq", "gauge", "Sequence number of the last collective the rank enqueued.")
        done = Family("gpuvigil_rank_collective_completed_seq", "gauge", "Sequence number of the last collective the rank completed.")
        lag = Family("gpuvigil_rank_collective_pending", "gauge", "Collectives enqueued but not completed by the rank.")
        info = Family("gpuvigil_rank", "info", "Where a rank runs.")
        prog = self._running_ranks("rank_progress")
        if prog.height:
            cols = ["job", "rank", "node", "gpu", "pg", "last_enqueued_seq", "last_completed_seq", "step", "step_time_seconds"]
            for job, rank, node, gpu, pg, enq_seq, done_seq, step_no, st in _rows(prog, cols):
                if st is not None:
                    step_time.add(st, job=job, rank=rank)
                if step_no is not None:
                    step.add(step_no, job=job, rank=rank)
                if enq_seq is not None:
                    enq.add(enq_seq, job=job, rank=rank)
                if done_seq is not None:
                    done.add(done_seq, job=job, rank=rank)
                if enq_seq is not None and done_seq is not None:
                    lag.add(max(0, enq_seq - done_seq), job=job, rank=rank)
                info.add(1, job=job, rank=rank, node=node or "", gpu="" if gpu is None else gpu, pg=pg or "")
        alloc = Family("gpuvigil_rank_memory_allocated_bytes", "gauge", "Bytes held by live tensors (PyTorch allocated).")
        reserved = Family("gpuvigil_rank_memory_reserved_bytes", "gauge", "Bytes reserved by the PyTorch caching allocator.")
        free_block = Family("gpuvigil_rank_memory_largest_free_block_bytes", "gauge", "Largest free block in the caching allocator.")
        headroom = Family("gpuvigil_rank_memory_headroom_bytes", "gauge", "Capacity minus the rank's per-step peak minus memory held by other processes.")
        retries = Family("gpuvigil_rank_alloc_retries", "counter", "cudaMalloc retries after freeing cached blocks.")
        ooms = Family("gpuvigil_rank_ooms", "counter", "Out-of-memory errors the rank raised.")
        mem = self._running_ranks("allocator_stats")
        if mem.height:
            mem = mem.with_columns(
                (
                    pl.col("device_capacity_bytes")
                    - pl.max_horizontal(pl.col("peak_allocated_bytes"), pl.col("reserved_bytes")).fill_null(0)
                    - pl.col("foreign_used_bytes").fill_null(0)
                ).alias("headroom")
            )
            cols = ["job", "rank", "allocated_bytes", "reserved_bytes", "largest_free_block_bytes", "headroom", "alloc_retries", "oom_count"]
            for job, rank, a, r, fb, hr, rt, oc in _rows(mem, cols):
                for fam, value in ((alloc, a), (reserved, r), (free_block, fb), (headroom, hr), (retries, rt), (ooms, oc)):
                    if value is not None:
                        fam.add(value, job=job, rank=rank)
        return [step_time, step, enq, done, lag, info, alloc, reserved, free_block, headroom, retries, ooms]

    def _job_families(self) -> list[Family]:
        sched = self.runtime.scheduler
        info = Family("gpuvigil_job", "info", "A scheduler job: tenant, priority, owning team, state.")
        gpus = Family("gpuvigil_job_gpus", "gauge", "GPUs the job asks for.")
        restarts = Family("gpuvigil_job_restarts", "counter", "Times the job was requeued.")
        for name, js in sched.jobs.items():
            if js.state == "completed":
                continue
            info.add(1, job=name, tenant=js.spec.tenant, priority=js.spec.priority, team=self.team_of_tenant(js.spec.tenant), state=js.state)
            gpus.add(js.spec.n_gpus, job=name)
            restarts.add(js.restarts, job=name)
        headroom = Family("gpuvigil_job_memory_headroom_ratio", "gauge", "Smallest headroom of the job's ranks as a fraction of device capacity.")
        mem = self._running_ranks("allocator_stats")
        if mem.height:
            per_job = (
                mem.with_columns(
                    (
                        (
                            pl.col("device_capacity_bytes")
                            - pl.max_horizontal(pl.col("peak_allocated_bytes"), pl.col("reserved_bytes")).fill_null(0)
                            - pl.col("foreign_used_bytes").fill_null(0)
                        )
                        / pl.col("device_capacity_bytes")
                    ).alias("ratio")
                )
                .group_by("job")
                .agg(pl.col("ratio").min())
                .sort("job")
                .drop_nulls("ratio")
            )
            for job, ratio in _rows(per_job, ["job", "ratio"]):
                headroom.add(ratio, job=job)
        tto = Family("gpuvigil_job_predicted_oom_seconds", "gauge", "Predicted time until the job runs out of device memory (only while an OOM is predicted).")
        soonest: dict[str, float] = {}
        for f in self.runtime.pipeline.active.values():
            if f.kind != FindingKind.OOM_PREDICTED or not f.job:
                continue
            seconds = time_to_oom_seconds(f)
            if seconds is not None:
                soonest[f.job] = min(seconds, soonest.get(f.job, seconds))
        for job, seconds in sorted(soonest.items()):
            tto.add(max(0.0, seconds), job=job)
        # Observation level per job (docs/levels.md): 0 = device telemetry + logs + job map,
        # 1 = + Flight Recorder / NCCL Inspector switches, 2 = + the in-process hook.
        level = Family("gpuvigil_job_observation_level", "gauge", "Observation level of the job: 0 (L0 device/logs), 1 (L1 + Flight Recorder/NCCL Inspector), 2 (L2 in-process hook).")
        levels = getattr(getattr(self.runtime.pipeline, "levels", None), "job_levels", lambda: {})()
        for job, lvl in sorted(levels.items()):
            level.add(int(lvl[1:]), job=job)
        return [info, gpus, restarts, headroom, tto, level]

    def _finding_families(self) -> list[Family]:
        kinds = [k.value for k in FindingKind]
        sevs = [s.value for s in Severity]
        total = Family("gpuvigil_findings", "counter", "Findings raised (a persisting cause counts once).")
        for kind in kinds:
            for sev in sevs:
                total.add(self.stats.findings_by_kind.get((kind, sev), 0), kind=kind, severity=sev)
        active_counts: Counter[tuple[str, str]] = Counter()
        by_node: Counter[tuple[str, str, str]] = Counter()
        by_job: Counter[tuple[str, str, str]] = Counter()
        for f in self.runtime.pipeline.active.values():
            active_counts[(f.kind.value, f.severity.value)] += 1
            if f.node:
                by_node[(f.node, f.kind.value, f.severity.value)] += 1
            if f.job:
                by_job[(f.job, f.kind.value, f.severity.value)] += 1
        active = Family("gpuvigil_findings_active", "gauge", "Findings active now.")
        for kind in kinds:
            for sev in sevs:
                active.add(active_counts.get((kind, sev), 0), kind=kind, severity=sev)
        node_active = Family("gpuvigil_node_findings_active", "gauge", "Findings active now on a node.")
        for (node, kind, sev), n in sorted(by_node.items()):
            node_active.add(n, node=node, kind=kind, severity=sev)
        job_active = Family("gpuvigil_job_findings_active", "gauge", "Findings active now for a job.")
        for (job, kind, sev), n in sorted(by_job.items()):
            job_active.add(n, job=job, kind=kind, severity=sev)
        return [total, active, node_active, job_active]

    def _node_families(self) -> list[Family]:
        sched = self.runtime.scheduler
        state = Family("gpuvigil_node_state", "gauge", "1 for the node's current scheduler state.")
        gpus = Family("gpuvigil_node_gpus", "gauge", "GPUs on the node.")
        free = Family("gpuvigil_node_free_gpus", "gauge", "GPUs on the node a new job could use now.")
        info = Family("gpuvigil_node", "info", "Node placement (rack).")
        for name, ns in sched.nodes.items():
            for s in NODE_STATES:
                state.add(1 if ns.state == s else 0, node=name, state=s)
            gpus.add(ns.spec.n_gpus, node=name)
            free.add(len(ns.free_gpus()) if ns.schedulable else 0, node=name)
            info.add(1, node=name, rack=ns.spec.rack)
        return [state, gpus, free, info]

    def _ib_families(self) -> list[Family]:
        """InfiniBand/RoCE ports (collectors/infiniband.py): the latest read of each port."""
        fams = [Family(name, typ, help) for name, typ, _col, help, _scale in IB_SPECS]
        up = Family(*IB_UP)
        ports = Family(*IB_PORTS)
        info = Family(*IB_INFO)
        window = self.runtime.pipeline.window
        df = window.get("ib_ports")
        if df.height == 0 or "device" not in df.columns:
            return [up, *fams, ports, info]
        # The newest read of each node: its ports now (one gone from it is gone from here too).
        newest = df.group_by("node").agg(pl.col("ts").max().alias("_newest"))
        latest = df.join(newest, on="node").filter(pl.col("ts") == pl.col("_newest")).unique(["node", "device", "port"], keep="last", maintain_order=True)
        for node, n in latest.group_by("node").agg(pl.col("device").is_not_null().sum()).sort("node").iter_rows():
            ports.add(n, node=node)
        latest = latest.filter(pl.col("device").is_not_null()).sort("node", "device", "port")
        cols = ["node", "device", "port", "link_layer", "state", "pci_bus_id", "affinity", "gpus", *[c for _, _, c, _, _ in IB_SPECS]]
        for node, device, port, layer, state, bus, affinity, gpus, *values in _rows(latest, cols):
            key = {"node": node, "device": device, "port": port, "link_layer": layer or ""}
            up.add(1 if state == "ACTIVE" else 0, **key)
            for fam, (_, _, _, _, scale), value in zip(fams, IB_SPECS, values, strict=True):
                if value is not None:
                    fam.add(value * scale, **key)
            info.add(1, **key, pci_bus_id=bus or "", affinity=affinity or "", gpus=",".join(map(str, gpus or [])))
        return [up, *fams, ports, info]

    def _scheduler_families(self) -> list[Family]:
        sched = self.runtime.scheduler
        now = self.runtime.now
        by_state: Counter[str] = Counter()
        fragmented_free = 0
        total_free = 0
        largest_free = 0
        for ns in sched.nodes.values():
            used = len(ns.used)
            free_list = ns.free_gpus()
            by_state["allocated"] += used
            if ns.schedulable:
                by_state["free"] += len(free_list)
                by_state["avoided"] += len([g for g in ns.avoid_gpus if g not in ns.used])
                total_free += len(free_list)
                largest_free = max(largest_free, len(free_list))
                if 0 < len(free_list) < ns.spec.n_gpus:
                    fragmented_free += len(free_list)
            else:
                by_state["cordoned" if ns.state == "cordoned" else "unavailable"] += ns.spec.n_gpus - used
        gpus = Family("gpuvigil_scheduler_gpus", "gauge", "GPUs by scheduler state (allocated, free, cordoned, avoided, unavailable).")
        for s in ("allocated", "free", "cordoned", "avoided", "unavailable"):
            gpus.add(by_state.get(s, 0), state=s)
        frag = Family("gpuvigil_scheduler_fragmentation_ratio", "gauge", "Fraction of free GPUs on partly used nodes (cannot host a whole-node job).")
        frag.add(fragmented_free / total_free if total_free else 0.0)
        largest = Family("gpuvigil_scheduler_largest_free_block_gpus", "gauge", "Most free GPUs on any one schedulable node.")
        largest.add(largest_free)
        queue = Family("gpuvigil_scheduler_queue_jobs", "gauge", "Jobs waiting to be placed.")
        oldest = Family("gpuvigil_scheduler_queue_oldest_wait_seconds", "gauge", "How long the oldest waiting job has waited.")
        jobs_state = Family("gpuvigil_scheduler_jobs", "gauge", "Jobs by state.")
        lost = Family("gpuvigil_scheduler_lost_gpu_seconds", "counter", "GPU time lost to restarts (work since the last checkpoint).")
        pending: Counter[tuple[str, str]] = Counter()
        waits: dict[tuple[str, str], float] = {}
        states: Counter[str] = Counter()
        lost_by: Counter[tuple[str, str]] = Counter()
        keys: set[tuple[str, str]] = set()
        for js in sched.jobs.values():
            key = (js.spec.priority, js.spec.tenant)
            keys.add(key)
            states[js.state] += 1
            lost_by[key] += js.lost_gpu_seconds
            if js.state == "pending" and js.spec.submit_ts <= now:
                pending[key] += 1
                since = self.stats._requeued_at.get(js.spec.name, js.spec.submit_ts)
                waits[key] = max(waits.get(key, 0.0), now - since)
        for key in sorted(keys):
            queue.add(pending.get(key, 0), priority=key[0], tenant=key[1])
            oldest.add(max(0.0, waits.get(key, 0.0)), priority=key[0], tenant=key[1])
            lost.add(lost_by.get(key, 0.0), priority=key[0], tenant=key[1])
        for s in JOB_STATES:
            jobs_state.add(states.get(s, 0), state=s)
        preempt = Family("gpuvigil_scheduler_preemptions", "counter", "Jobs preempted for higher-priority work.")
        requeues = Family("gpuvigil_scheduler_requeues", "counter", "Jobs stopped and requeued from their checkpoint (by a hint, a crash or compaction).")
        for key in sorted(keys):
            preempt.add(self.stats.preemptions.get(key, 0), priority=key[0], tenant=key[1])
            requeues.add(self.stats.requeues.get(key, 0), priority=key[0], tenant=key[1])
        actions = Family("gpuvigil_scheduler_actions", "counter", "Scheduler actions taken, by action.")
        for action, n in sorted(self.stats.actions_by_kind.items()):
            actions.add(n, action=action)
        wait_hist = self.stats.waits.family("gpuvigil_scheduler_queue_wait_seconds", "Time jobs waited in the queue before being placed.")
        return [gpus, frag, largest, queue, oldest, jobs_state, lost, preempt, requeues, actions, wait_hist]

    def _pipeline_families(self) -> list[Family]:
        pipeline = self.runtime.pipeline
        ticks = Family("gpuvigil_pipeline_ticks", "counter", "Pipeline ticks run.")
        ticks.add(pipeline.ticks)
        samples = Family("gpuvigil_pipeline_samples_ingested", "counter", "Rows ingested from collectors.")
        samples.add(pipeline.samples_ingested_total)
        errors = Family("gpuvigil_collector_errors", "counter", "Samples a collector dropped as malformed or unreadable.")
        for collector in pipeline.collectors:
            errors.add(collector.errors, collector=collector.name)
        # Per collector target: 0 once it failed collector_down_after_failures collects in a row.
        up = Family("gpuvigil_collector_up", "gauge", "1 when the collector's target (endpoint, device, file) was read; 0 while it is down.")
        failing = Family("gpuvigil_collector_consecutive_failures", "gauge", "Failed collects in a row of the collector's target.")
        for h in pipeline.health.rows() if hasattr(pipeline, "health") else ():
            up.add(1.0 if h.up else 0.0, collector=h.collector, target=h.target)
            failing.add(h.consecutive_failures, collector=h.collector, target=h.target)
        sim = Family("gpuvigil_pipeline_time_seconds", "gauge", "Pipeline clock (simulated seconds for the simulator, Unix time for real sources).")
        sim.add(self.runtime.now)
        last = self.runtime.last_result
        last_dur = Family("gpuvigil_pipeline_last_tick_duration_seconds", "gauge", "Wall time of the last tick.")
        if last is not None:
            last_dur.add(last.duration_seconds)
        window_rows = Family("gpuvigil_pipeline_window_rows", "gauge", "Rows held in the window, by stream.")
        for stream in pipeline.window.streams():
            window_rows.add(pipeline.window.get(stream).height, stream=stream)
        return [
            ticks,
            samples,
            errors,
            up,
            failing,
            sim,
            last_dur,
            window_rows,
            self.stats.tick_seconds.family("gpuvigil_pipeline_tick_duration_seconds", "Wall time of one pipeline tick."),
            self.stats.detector_seconds.family("gpuvigil_detector_duration_seconds", "Wall time of one detector run."),
        ]


