"""Start what a `sources:` section (gpuvigil.config.deploy.Sources) names: one collector per source.
The pipeline contains a collector that fails and tracks its health (`pipeline/health.py`); a
source's `up` is read from there, so there is one account of what is down.

`build(sources, cfg)` starts them in order and raises `UserError` naming the first source that
cannot start; nothing falls back to the simulator. Each `Source` says what it is, where it reads
and its state, for the one-line-per-source start-up log.
"""

from __future__ import annotations

import glob
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import polars as pl

from gpuvigil import schemas
from gpuvigil.config.deploy import pattern_glob, pattern_regex, pattern_root, split_address
from gpuvigil.errors import UserError
from gpuvigil.pipeline.health import HealthTracker

log = logging.getLogger("gpuvigil.app.serve")


class Every:
    """Calls a snapshot collector at most every `seconds` (monotonic); in between it yields
    nothing and the window keeps the previous snapshot."""

    def __init__(self, collector: Any, seconds: float):
        self.inner = collector
        self.seconds = seconds
        self.name = getattr(collector, "name", "every")
        self.streams = getattr(collector, "streams", {})
        self._at: float | None = None

    @property
    def errors(self) -> int:
        return int(getattr(self.inner, "errors", 0))

    @errors.setter
    def errors(self, value: int) -> None:  # the pipeline counts a collect that raised
        self.inner.errors = value

    @property
    def last_error(self) -> str | None:
        return getattr(self.inner, "last_error", None)

    def collect(self, now: float) -> dict[str, pl.DataFrame]:
        mono = time.monotonic()
        if self._at is not None and mono - self._at < self.seconds:
            return {}
        self._at = mono
        return self.inner.collect(now)


@dataclass
class Source:
    kind: str  # nvml | dcgm | kernel_log | logs | flight_recorder | hook | scheduler
    where: str
    collector: Any = None
    detail: str = ""
    closers: list[Callable[[], None]] = field(default_factory=list)
    up_fn: Callable[[], bool] | None = None  # for sources without a collector (e.g. the receiver)
    # The pipeline's collector health (set by serve once the pipeline exists): a source is up when
    # its collector's last read worked. The pipeline contains a failing collect and counts it.
    health: HealthTracker | None = None

    @property
    def label(self) -> tuple[str, str]:
        """How the health tracker's log lines name it (pipeline/health.py)."""
        return f"source {self.kind}", self.where

    @property
    def up(self) -> bool:
        if self.up_fn is not None:
            return self.up_fn()
        if self.collector is None:
            return True
        return self.health is not None and self.health.last_read_ok(self.collector.name)

    def line(self) -> str:
        """The start-up line: what it reads, and its state. A source with a collector is up only
        after its first successful read; the pipeline's health tracker logs that, and every later
        change of state, under the same name (`label`)."""
        why = self.health.reason(self.collector.name) if self.health is not None and self.collector is not None else None
        unread = self.up_fn is None and self.collector is not None and (self.health is None or not self.health.read_yet(self.collector.name))
        state = "waiting for its first read" if unread else "up" if self.up else f"DOWN ({why or ''})"
        return f"source {self.kind}: {self.where}" + (f" ({self.detail})" if self.detail else "") + f": {state}"

    def close(self) -> None:
        for fn in reversed(self.closers):
            fn()
        close = getattr(self.collector, "close", None)
        if callable(close):
            close()


class LogGlobCollector:
    """Torch/NCCL logs matching a path pattern: each file found is tailed by an NcclLogCollector
    with the job, rank and node taken from the pattern's `{job}`, `{rank}`, `{node}`. The pattern
    is re-globbed every `rescan_seconds`; files present at start are read from their end (their
    past is not news), files that appear later from their start."""

    streams: Mapping[str, pl.Schema] = {"events": schemas.EVENTS}

    def __init__(self, pattern: str, *, node: str, rescan_seconds: float = 2.0, max_files: int = 4096,
                 job_of: Callable[[str], str | None] | None = None, wait_for_job_seconds: float = 30.0):
        self.job_of = job_of  # the scheduler's answer for paths the pattern does not name a job in
        self.wait_for_job_seconds = wait_for_job_seconds
        self._first_seen: dict[str, float] = {}
        self.pattern = pattern
        self.name = f"logs:{pattern}"
        self.node = node
        self.glob = pattern_glob(pattern)
        self.regex = pattern_regex(pattern)
        self.rescan_seconds = rescan_seconds
        self.max_files = max_files
        self.files: dict[str, tuple[Any, int | None]] = {}
        self._errors = 0
        self._scanned_at: float | None = None
        self.last_error: str | None = None

    @property
    def errors(self) -> int:
        return self._errors + sum(c.errors for c, _ in self.files.values())

    def _scan(self, first: bool) -> None:
        from gpuvigil.collectors.nccl_log import NcclLogCollector

        for path in sorted(glob.glob(self.glob, recursive="**" in self.glob)):
            if path in self.files or not os.path.isfile(path):
                continue
            if len(self.files) >= self.max_files:
                self._errors += 1
                self.last_error = f"more than {self.max_files} files match {self.pattern}; the rest are not read"
                break
            m = self.regex.match(path)
            groups = m.groupdict() if m else {}
            rank = int(groups["rank"]) if groups.get("rank") else None
            job = groups.get("job")
            if job is None and self.job_of is not None:
                job = self.job_of(path)
                seen = self._first_seen.setdefault(path, time.monotonic())
                if job is None and time.monotonic() - seen < self.wait_for_job_seconds:
                    continue  # the scheduler may not list the job yet: ask again at the next scan
            collector = NcclLogCollector(path, node=groups.get("node") or self.node, job=job, from_start=not first)
            self.files[path] = (collector, rank)
            log.info("logs: reading %s (job %s, rank %s)", path, job or "?", "?" if rank is None else rank)

    def collect(self, now: float) -> dict[str, pl.DataFrame]:
        mono = time.monotonic()
        if self._scanned_at is None or mono - self._scanned_at >= self.rescan_seconds:
            self._scan(first=self._scanned_at is None)
            self._scanned_at = mono
        frames = []
        for collector, rank in self.files.values():
            ev = collector.collect(now).get("events")
            if ev is None or ev.height == 0:
                continue
            if rank is not None:
                ev = ev.with_columns(pl.col("rank").fill_null(rank))
            frames.append(ev)
        return {"events": pl.concat(frames, how="vertical_relaxed")} if frames else {}

    def close(self) -> None:
        for collector, _ in self.files.values():
            collector.tail.close()


def _kernel_log(spec: str, node: str, cfg: dict[str, Any], pci_to_gpu: dict[str, int] | None = None) -> Source:
    from gpuvigil.collectors import kernel_log as kl

    if spec not in ("kmsg", "journald"):
        path = Path(spec)
        if not path.is_file():
            raise UserError(f"source kernel_log: {spec}: no such file (kernel_log takes kmsg, journald or the path of a kernel log file)")
        if not os.access(path, os.R_OK):
            raise UserError(f"source kernel_log: {spec}: not readable by this user")
    try:
        collector = kl.KernelLogCollector(spec, node=node, cfg=cfg, pci_to_gpu=pci_to_gpu)
    except (kl.KernelLogUnavailable, OSError) as exc:
        raise UserError(f"source kernel_log: cannot read {spec}: {exc}") from exc
    return Source("kernel_log", str(collector.source.where), collector, f"{collector.source.kind}; XIDs; {_describe(collector)}")


def _describe(collector: Any) -> str:
    describe = getattr(collector, "describe", None)
    return describe() if callable(describe) else ""


def _hook(address: str, node: str) -> Source:
    from gpuvigil.collectors.hook import HookCollector, HookReceiver

    host, port = split_address(address)
    collector = HookCollector()
    try:
        receiver = HookReceiver(collector, host, port).start()
    except OSError as exc:
        raise UserError(f"source hook: cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    src = Source("hook", receiver.url, collector, "in-process hook records (HttpSink)")
    src.closers.append(receiver.stop)
    src.receiver = receiver  # type: ignore[attr-defined]
    return src


def slurm_job_of_path(refresh_seconds: float = 5.0, slurm: Any = None) -> Callable[[str], str | None]:
    """path → the Slurm job whose StdOut or StdErr it is (`scontrol -o show job`, which prints
    them with %j, %N, ... expanded), refreshed at most every `refresh_seconds`."""
    from gpuvigil.scheduler.slurm import Slurm, SlurmError, parse_scontrol_record

    slurm = slurm or Slurm(timeout=10)
    state: dict[str, Any] = {"at": None, "owners": {}}

    def refresh() -> None:
        owners: dict[str, str] = {}
        try:
            text = slurm.run("scontrol", "-o", "show", "job")
        except SlurmError as exc:
            log.warning("logs: cannot ask Slurm whose log a file is: %s", exc)
            return
        for line in text.splitlines():
            if not line.startswith("JobId="):
                continue
            kv = dict(parse_scontrol_record(line))
            for key in ("StdOut", "StdErr"):
                if kv.get(key, "").startswith("/"):
                    owners[os.path.realpath(kv[key])] = kv["JobId"]
        state["owners"] = owners

    def job_of(path: str) -> str | None:
        real = os.path.realpath(path)
        now = time.monotonic()
        if real not in state["owners"] and (state["at"] is None or now - state["at"] >= refresh_seconds):
            state["at"] = now
            refresh()
        return state["owners"].get(real)

    return job_of


def _slurm(cfg: dict[str, Any], poll_seconds: float) -> Source:
    from gpuvigil.scheduler.slurm import Slurm, SlurmError, SlurmState, SlurmStateCollector, slurm_config

    sc = slurm_config(cfg)
    state = SlurmState(Slurm(timeout=sc.command_timeout_seconds))
    try:
        nodes = state.nodes()
        jobs = state.jobs()
    except SlurmError as exc:
        raise UserError(f"source scheduler slurm: cannot read cluster state: {exc}") from exc
    conf = os.environ.get("SLURM_CONF", "/etc/slurm/slurm.conf")
    detail = f"job map from squeue/sinfo every {poll_seconds:g} s; {len(nodes)} node(s), {len(jobs)} job(s)"
    return Source("scheduler", f"slurm ({conf})", Every(SlurmStateCollector(state, sc), poll_seconds), detail)


@dataclass
class BuildContext:
    """What a source's builder is given besides the section: this node's name, the whole config,
    and the sources started before it (the kernel log names GPUs by NVML's PCI bus ids)."""

    node: str
    cfg: dict[str, Any]
    started: list[Source]

    def collector_of(self, kind: str) -> Any:
        return next((s.collector for s in self.started if s.kind == kind and s.collector is not None), None)


def build(sources: Any, cfg: dict[str, Any]) -> list[Source]:
    """Start every configured source, each by its registered builder in its declared order
    (deployconfig.SOURCE_SPECS); UserError names the first one that cannot start."""
    import importlib

    from gpuvigil.config.deploy import SOURCE_SPECS

    ctx = BuildContext(sources.node_name(), cfg, [])
    try:
        for spec in sorted(SOURCE_SPECS, key=lambda s: s.order):
            if spec.build is None or not (spec.always or spec.is_set(getattr(sources, spec.key))):
                continue
            module, _, attr = spec.build.partition(":")
            ctx.started.extend(getattr(importlib.import_module(module), attr)(sources, ctx))
    except BaseException:
        for src in ctx.started:
            src.close()
        raise
    return ctx.started


def build_nvml(sources: Any, ctx: BuildContext) -> list[Source]:
    try:
        import gpuvigil.collectors.nvml as nvml
    except ImportError as exc:
        raise UserError(f"source nvml: cannot start: {exc} (pip install nvidia-ml-py)") from exc
    try:
        collector = nvml.NvmlCollector(node=ctx.node)
    except nvml.NvmlUnavailable as exc:
        raise UserError(f"source nvml: cannot start: {str(exc).split('; use the simulated')[0]}") from exc
    return [Source("nvml", f"NVML on {ctx.node}", collector, f"{len(collector.handles)} GPU(s)")]


def build_dcgm(sources: Any, ctx: BuildContext) -> list[Source]:
    from gpuvigil.collectors.dcgm import DcgmCollector

    # One collector for every endpoint: scraped concurrently, each with its own timeout.
    dcgm = DcgmCollector(list(sources.dcgm), node=None)
    where = sources.dcgm[0] if len(sources.dcgm) == 1 else f"{len(sources.dcgm)} endpoints ({sources.dcgm[0]}, ...)"
    return [Source("dcgm", where, dcgm, "dcgm-exporter scrapes, concurrent")]


def build_kernel_log(sources: Any, ctx: BuildContext) -> list[Source]:
    # NVML's PCI bus ids name the GPU of each XID line (and, through the job map, its job).
    bus_ids = getattr(ctx.collector_of("nvml"), "pci_bus_ids", None) or []
    return [_kernel_log(sources.kernel_log, ctx.node, ctx.cfg, {b: i for i, b in enumerate(bus_ids) if b})]


def build_logs(sources: Any, ctx: BuildContext) -> list[Source]:
    out = []
    for pattern in sources.logs:
        root = pattern_root(pattern)
        job_of = slurm_job_of_path() if sources.scheduler == "slurm" and "{job}" not in pattern else None
        collector = LogGlobCollector(pattern, node=ctx.node, job_of=job_of)
        if "{job}" in pattern:
            how = "job, rank from the path"
        elif job_of is not None:
            how = "job from Slurm (the job whose StdOut/StdErr is the file), rank from the lines"
        else:
            how = "no {job} in the pattern: its events carry no job; a timeout pages naming the node and file"
        if not root.is_dir():
            # Jobs create their log folders: not an error, but said at start (a typo shows here).
            how += f"; {root} does not exist yet"
        out.append(Source("logs", pattern, collector, how))
    return out


def build_flight_recorder(sources: Any, ctx: BuildContext) -> list[Source]:
    return [_flight_recorder(sources.flight_recorder, ctx.node)]


def build_nccl_inspector(sources: Any, ctx: BuildContext) -> list[Source]:
    from gpuvigil.collectors.nccl_inspector import NcclInspectorCollector

    return [Source("nccl_inspector", sources.nccl_inspector, NcclInspectorCollector(sources.nccl_inspector),
                   "<job>/ NCCL Inspector records (JSON or Prometheus textfile) as per-rank collective progress (L1)")]


def build_hook(sources: Any, ctx: BuildContext) -> list[Source]:
    return [_hook(sources.hook, ctx.node)]


def build_infiniband(sources: Any, ctx: BuildContext) -> list[Source]:
    from gpuvigil.collectors.infiniband import InfinibandCollector

    root = "/sys" if sources.infiniband is True else str(sources.infiniband)
    # NVML's PCI bus ids place each port beside its GPUs (same PCIe switch, else NUMA node).
    nvml = next((s.collector for s in ctx.started if s.kind == "nvml" and s.collector is not None), None)
    ib = InfinibandCollector(root, node=ctx.node, pci_to_gpu=getattr(nvml, "pci_to_gpu", None))
    ports = ib.read(time.time()).filter(pl.col("device").is_not_null()).height
    return [Source("infiniband", str(ib.base), ib, f"{ports} port(s); GPUs from {'NVML' if nvml is not None else 'nothing (node level)'}")]


def build_job_map(sources: Any, ctx: BuildContext) -> list[Source]:
    job_map = _job_map(sources, ctx.node, ctx.started)
    return [job_map] if job_map is not None else []


def build_scheduler(sources: Any, ctx: BuildContext) -> list[Source]:
    if sources.scheduler == "slurm":
        return [_slurm(ctx.cfg, sources.scheduler_poll_seconds)]
    return [Source("scheduler", "kubernetes", None, "acting only: no job map from the API server in this build")]


PODRESOURCES_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"


def _job_map(sources: Any, node: str, started: list[Source]) -> Source | None:
    """GPU → job, rank from what this node has: the job-mapping folder, NVML's processes (their
    /proc environment and cgroup; `scontrol pidinfo` under Slurm), the kubelet's PodResources."""
    from gpuvigil.collectors.jobmap import JobMapCollector

    nvml = next((s.collector for s in started if s.kind == "nvml" and s.collector is not None), None)
    socket_path = PODRESOURCES_SOCKET if sources.scheduler == "kubernetes" and Path(PODRESOURCES_SOCKET).exists() else None
    if not (sources.job_map_dir or nvml is not None or socket_path):
        return None
    if sources.job_map_dir and not Path(sources.job_map_dir).is_dir():
        log.info("job map: %s does not exist yet (the Slurm prolog creates it with the first GPU job)", sources.job_map_dir)
    processes = getattr(nvml, "processes", None) if nvml is not None else None
    collector = JobMapCollector(
        node=node,
        processes=processes,
        hpc_job_mapping_dir=sources.job_map_dir,
        podresources_socket=socket_path,
        scontrol="scontrol" if sources.scheduler == "slurm" and processes is not None else None,
        uuid_to_gpu=getattr(nvml, "uuid_to_gpu", None),  # every GPU's UUID, not only those running a process
    )
    return Source("job_map", sources.job_map_dir or node, collector, _describe(collector))


def _flight_recorder(folder: str, node: str) -> Source:
    from gpuvigil.collectors.fr_dumps import FrDumpTrigger, FrDumpWatcher, FrRequests, pipe_writer

    path = Path(folder)
    if not path.is_dir():
        # gpuvigil's drop folder: ranks of any user write <job>/ folders into it (sticky, like /tmp).
        try:
            path.mkdir(parents=True)
            path.chmod(0o1777)
        except OSError as exc:
            raise UserError(f"source flight_recorder: cannot create {folder}: {exc.strerror or exc}") from exc
        log.info("flight_recorder: created %s (mode 1777)", path)
    requests = FrRequests()
    src = Source("flight_recorder", str(path), FrDumpWatcher(path, node=node, requests=requests),
                 "<job>/ dumps analysed across ranks as they appear; debug-info pipes written when a hang is suspected")
    # The trigger that asks a suspected-hung job's ranks to dump: a sink of serve's pipeline, and
    # in the fleet's agent what writes the pipes detect asks for (app/compose.py DUMP_TRIGGER).
    src.sink = FrDumpTrigger(pipe_writer(path), requests)  # type: ignore[attr-defined]
    return src
