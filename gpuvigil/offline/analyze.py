"""`gpuvigil analyze PATH...`: offline diagnosis of whatever files the on-call engineer has.

Takes any mix of files and folders and recognises each file by its content, not its name:
kernel logs (XIDs), training / NCCL logs (watchdog timeouts, NCCL warnings, CUDA OOMs), Flight
Recorder dumps (pickle or JSON; all dumps of one folder are analysed together, across ranks),
`torch.cuda.memory_stats()` JSON, memory snapshot pickles, saved `/metrics` scrapes (dcgm-exporter
or gpuvigil's own), and NVML time-series CSV. Prints the findings sorted by time, as readable
blocks or as JSON lines (`--format json`).

A training / NCCL log is judged by the very detectors `serve` runs (`watchdog`, `nccl_error`,
`oom_events`): its lines become the `events` the log collector emits live, and those detectors
look at all of them at once (`training_log_findings`).

Untrusted input: pickles are only ever read through the restricted unpickler (by the Flight
Recorder and allocator readers). A file that cannot be read or is refused gets one line on
stderr naming it, and the others are still analysed; the exit code is 2 only when nothing at
all could be read.
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import polars as pl

from gpuvigil import config, schemas
from gpuvigil.collectors.safe_pickle import looks_like_pickle
from gpuvigil.errors import UserError
from gpuvigil.model import Finding, FindingKind, Severity
from gpuvigil.offline.formats import iter_files, parse_time
from gpuvigil.util.textsafe import printable

SNIFF_BYTES = 256 * 1024
SEVERITY_ORDER = {Severity.PAGE: 0, Severity.TICKET: 1, Severity.INFO: 2}
# Bounds on untrusted input, checked before anything is loaded. Text logs are streamed line by
# line, each line cut at MAX_LINE_CHARS (the rest of a runaway line is skipped, never held);
# whole-file readers refuse files over their size limit from the file's size alone.
MAX_LINE_CHARS = 64 * 1024
MAX_TABLE_BYTES = 256 * 1024 * 1024  # NVML CSV (polars reads it whole)
MAX_SCRAPE_BYTES = 64 * 1024 * 1024  # a saved /metrics page
# What is printed of one message (`message` evidence); the JSON output carries the same cut text.
MAX_MESSAGE_CHARS = 2000
# The registered detectors that judge one saved dcgm-exporter scrape.
SCRAPE_DETECTORS = ("xid", "ecc", "nvlink_fabric", "memory_repair")


@dataclass
class Report:
    findings: list[Finding] = field(default_factory=list)
    read: list[str] = field(default_factory=list)  # files analysed (whether or not they had findings)
    errors: list[str] = field(default_factory=list)  # one line each, naming the file
    formats: dict[str, str] = field(default_factory=dict)  # file → detected format
    # file → (where its undated findings were put, "file time" or "--at"): a log with no
    # timestamps is placed at its file's modification time unless the user gives --at
    placed: dict[str, tuple[float, str]] = field(default_factory=dict)


def _optional(module: str) -> Any | None:
    """Import a reader another part of gpuvigil provides; None if it is not installed."""
    import importlib

    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name == module:
            return None
        raise


def _head(path: Path) -> bytes:
    with open(path, "rb") as fh:
        return fh.read(SNIFF_BYTES)


def _is_json(head: bytes) -> bool:
    stripped = head.lstrip()
    return stripped[:1] in (b"{", b"[")


def _text_lines(path: Path) -> Iterable[str]:
    """The file's lines (universal newlines), each at most MAX_LINE_CHARS long: a 200 MB line is
    read in bounded pieces, its head kept and the rest skipped, so memory stays small."""
    with open(path, encoding="utf-8", errors="replace", newline=None) as fh:
        while line := fh.readline(MAX_LINE_CHARS):
            if len(line) == MAX_LINE_CHARS and not line.endswith("\n"):
                while (rest := fh.readline(MAX_LINE_CHARS)) and not rest.endswith("\n"):
                    pass
                line += "\n"
            yield line


# Log-line structure. Offline analysis pages from text, so a message only counts when it reads as
# a line a program logged, not as prose quoting one (a README, a runbook, a ticket). Real logs
# come with every prefix imaginable (loggers, launchers, syslog host names, pasted indented), so
# the test is what prose has and logs lack: plain words running into the message ("If you see
# `NVRM: Xid ...`", "the log then shows Watchdog caught ..."); a logger's prefix ends in a stamp,
# a bracket or a `tag:` instead. Lines inside Markdown code fences are quotations, and a Markdown
# document (a heading and lines of prose) is not a log at all.
_PLAIN_WORD = re.compile(r"[A-Za-z][a-z]{0,15},?")
_FENCE = re.compile(r"^\s{0,3}(?:```|~~~)")
_HEADING = re.compile(r"^#{1,6}\s+\S")
_LOGGED = re.compile(r"^\s*(?:\[|\d|[^\W\d]{2,12}\.?\s+\d{1,2}\s+\d{2}:|[\w.\-]+:\d+:\d+)")  # a stamp or tag first
_NEEDLES = ("Xid", "Watchdog caught", "out of memory", "NCCL", "enqueued", "ProcessGroupNCCL", "Traceback")


def _quoted_in_prose(line: str, phrase: re.Pattern[str]) -> bool:
    m = phrase.search(line)
    if m is None:
        return False
    run = 0
    for token in reversed(line[: m.start()].rstrip(" \t`'\"*_(<").split()):
        if not _PLAIN_WORD.fullmatch(token):
            break
        run += 1
    return run >= 2


def is_prose_document(lines: list[str]) -> bool:
    """A Markdown document: a heading and at least three lines of prose (eight plain words or
    more, not starting with a time stamp or a logger's tag)."""
    if not any(_HEADING.match(ln) for ln in lines):
        return False
    prose = sum(1 for ln in lines if not _LOGGED.match(ln) and sum(1 for w in ln.split() if _PLAIN_WORD.fullmatch(w.rstrip(".;:"))) >= 8)
    return prose >= 3


def log_lines(lines: Iterable[str], phrase: re.Pattern[str]) -> Iterator[str]:
    """`lines` with those that only quote a log message blanked (numbering kept): inside a
    Markdown code fence, or right after two or more plain words of prose."""
    fenced = False
    for line in lines:
        if _FENCE.match(line):
            fenced = not fenced
            yield "\n"
        elif not any(n in line for n in _NEEDLES):
            yield line
        elif fenced or _quoted_in_prose(line, phrase):
            yield "\n"
        else:
            yield line


def _mtime(path: Path) -> float:
    return path.stat().st_mtime


def _is_nvml_csv(head_text: str) -> bool:
    first = head_text.split("\n", 1)[0].lower()
    cols = {c.strip() for c in first.split(",")}
    return ("clock_event_reasons" in cols or "throttle_reasons" in cols) and bool(cols & {"t", "ts", "timestamp"})


def _is_prometheus(head_text: str) -> bool:
    return head_text.lstrip().startswith("# HELP") or head_text.lstrip().startswith("# TYPE") or "DCGM_FI_" in head_text


# NVML CSV columns -> gpu_samples columns (scale): what the `thermal` detector reads.
NVML_CSV_COLUMNS = {"temp_c": ("temperature_c", 1.0), "sm_clock": ("sm_clock_mhz", 1.0), "power_mw": ("power_w", 1e-3)}


def nvml_csv_samples(path: Path, display: str, node: str | None = None) -> pl.DataFrame:
    """An NVML time series (one row per sample; a time, a clock-event-reasons column and, where
    recorded, the GPU index, temperature, SM clock and power) as `gpu_samples` rows, each with
    `_line`, its line in the file. Rows without a time are left out: a series is judged in time."""
    try:
        df = pl.read_csv(path, infer_schema_length=10000)
    except (pl.exceptions.PolarsError, OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{display}: unreadable CSV: {str(exc).splitlines()[0]}") from exc
    tcol = next((c for c in ("ts", "t", "timestamp") if c in df.columns), None)
    rcol = next((c for c in ("clock_event_reasons", "throttle_reasons") if c in df.columns), None)
    if tcol is None or rcol is None:
        raise UserError(f"{display}: CSV without a time and a clock-event-reasons column")
    extra = [(pl.col(c).cast(pl.Float64, strict=False) * scale).alias(name) for c, (name, scale) in NVML_CSV_COLUMNS.items() if c in df.columns]
    rows = df.select(
        pl.col(tcol).cast(pl.Float64, strict=False).alias("ts"),
        pl.lit(node, pl.Utf8).alias("node"),
        (pl.col("gpu").cast(pl.Int32, strict=False) if "gpu" in df.columns else pl.lit(0, pl.Int32)).alias("gpu"),
        pl.col(rcol).cast(pl.Int64, strict=False).alias("throttle_reasons"),
        *extra,
        (pl.int_range(pl.len()) + 2).alias("_line"),  # header is line 1
    ).filter(pl.col("ts").is_not_null() & pl.col("ts").is_finite())
    return pl.concat([schemas.conform(rows, "gpu_samples"), rows.select("_line")], how="horizontal")


def analyze_nvml_csv(path: Path, display: str, node: str | None = None, cfg: dict[str, Any] | None = None) -> list[Finding]:
    """Thermal slowdowns in an NVML time series: its samples replayed, in time, through serve's
    `thermal` detector; each GPU's finding sourced to the line of the sample that made it."""
    # A series saved on a host names no node; serve never judges a sample without one, so the
    # replay names it "" (which `place` words as an unknown node) and the findings say None.
    samples = nvml_csv_samples(path, display, node or "")
    lines = {(ts, gpu): line for ts, gpu, line in samples.select("ts", "gpu", "_line").reverse().iter_rows()}
    found = detect_series(["thermal"], "gpu_samples", samples.drop("_line"), cfg)
    for f in found:
        f.node = f.node or None
        f.evidence["detector"] = f.source
        f.source = f"{display}:{lines.get((f.ts, f.gpu), '?')}"
    return found


def detect_series(names: Iterable[str], stream: str, rows: pl.DataFrame, cfg: dict[str, Any] | None) -> list[Finding]:
    """The registered detectors `names` over a saved time series of `stream`, one tick per
    distinct time in time order, as serve would have seen it: each cause once, as first
    reported, with `evidence.held_until_ts`, the last tick it was still reported."""
    from gpuvigil.app import compose
    from gpuvigil.window import Window

    detectors = compose.detectors(cfg, "analyze", only=names)
    window = Window(600.0)
    first: dict[str, Finding] = {}
    for (now,), tick in rows.sort("ts", maintain_order=True).group_by("ts", maintain_order=True):
        window.add(stream, tick)
        window.seal(float(now))  # type: ignore[arg-type]
        for detector in detectors:
            for f in detector.detect(window):
                first.setdefault(f.cause_key, f).evidence["held_until_ts"] = float(now)  # type: ignore[arg-type]
    return list(first.values())


def findings_from_gpuvigil_scrape(text: str, display: str, ts: float, cfg: dict[str, Any] | None = None) -> list[Finding]:
    """Findings gpuvigil itself had active when its `/metrics` was saved: the page's
    active-findings gauges as `active_findings` rows, judged by the registered detector."""
    from prometheus_client.parser import text_string_to_metric_families

    from gpuvigil.detectors import saved_readings

    rows = [
        {"ts": ts, "node": s.labels.get("node"), "job": s.labels.get("job"), "source": display, "metric": family.name,
         "kind": s.labels.get("kind"), "severity": s.labels.get("severity"), "active_count": s.value}
        for family in text_string_to_metric_families(text)
        if family.name in saved_readings.ACTIVE_FINDINGS_METRICS
        for s in family.samples
    ]
    return detect_once(["active_findings"], {"active_findings": schemas.frame(rows, "active_findings")}, ts, cfg)


def smi_findings(text: str, *, source_file: str | None = None, ts: float, node: str | None = None, cfg: dict[str, Any] | None = None) -> list[Finding]:
    """What saved `nvidia-smi -q` output says of each GPU's memory repairs and heat: its GPU
    blocks as `smi_health` rows, judged by the registered detector."""
    from gpuvigil.parsers import nvidia_smi

    rows = nvidia_smi.health_rows(nvidia_smi.health(nvidia_smi.parse(text)), ts=ts, node=node, source=source_file)
    return detect_once(["smi_health"], {"smi_health": schemas.frame(rows, "smi_health")}, ts, cfg)


def detect_once(names: Iterable[str], streams: dict[str, pl.DataFrame], ts: float, cfg: dict[str, Any] | None,
                source: str | None = None, *, horizon: float = 600.0) -> list[Finding]:
    """Findings of the registered detectors `names` over one snapshot (one tick at `ts`, seeing
    the last `horizon` seconds): what a saved scrape, a copy of a sysfs tree or a whole log says
    on its own, by the detectors serve runs. `source`: the file read; a finding a detector signed
    with its own name is sourced to the file instead (`file:gpu=N` for one GPU's), the detector's
    name kept as `evidence.detector`."""
    from gpuvigil.app import compose

    names = list(names)
    found = compose.detect_once(names, streams, ts, cfg, horizon=horizon)
    for f in found if source is not None else ():
        if f.source is None or f.source in names:  # signed by the detector, not by the file's reader
            if f.source is not None:
                f.evidence["detector"] = f.source
            f.source = source if f.gpu is None else f"{source}:gpu={f.gpu}"
    return found


def scrape_findings(samples: pl.DataFrame, xid_counters: Iterable[dict[str, Any]], ts: float, *, node: str | None = None,
                    cfg: dict[str, Any] | None = None, source: str | None = None) -> list[Finding]:
    """What one saved dcgm-exporter scrape says (its `gpu_samples`, and the XID counter series
    that label their code): XIDs, uncorrectable ECC and failed remaps, pending memory repairs,
    the NVLink fabric, by serve's own detectors on the frames the collector makes of its first
    scrape (each GPU's last XID an `xid` event at `ts`)."""
    from gpuvigil.collectors import dcgm

    events = dcgm.scrape_xid_events(samples, xid_counters, ts=ts, default_node=node)
    return detect_once(SCRAPE_DETECTORS, {"gpu_samples": samples, "events": events}, ts, cfg, source)


def is_sysfs_tree(path: Path) -> bool:
    """A copy of a machine's /sys (or /sys itself) with its RDMA ports: <path>/class/infiniband."""
    return path.is_dir() and (path / "class" / "infiniband").is_dir()


class Analyzer:
    def __init__(
        self, *, cfg: dict[str, Any] | None = None, job: str | None = None, node: str | None = None, pci_to_gpu: dict[str, int] | None = None, at: float | None = None
    ):
        self.cfg = cfg
        self.at = at  # where undated inputs are placed (--at); None: at each file's modification time
        self.job = job
        self.node = node
        self.pci_to_gpu = pci_to_gpu or {}
        self.fr = _optional("gpuvigil.collectors.flight_recorder")
        self.alloc = _optional("gpuvigil.collectors.allocator")

    def _is_fr(self, path: Path) -> bool:
        return bool(self.fr is not None and self.fr.is_flight_recorder_dump(path))

    def run(self, paths: list[Path], display: Callable[[Path], str] = str) -> Report:
        report = Report()
        fr_groups: dict[Path, list[Path]] = {}
        trees = [p for p in paths if is_sysfs_tree(p)]
        for tree in trees:
            self._analyze_sysfs(tree, display(tree), report)
        for path in iter_files([p for p in paths if p not in trees]):
            if isinstance(path, str):
                report.errors.append(path)
                continue
            name = display(path)
            n_before = len(report.findings)
            try:
                kind = self._analyze_file(path, name, report, fr_groups)
            except UserError as exc:
                report.errors.append(_one_line(str(exc), name))
                continue
            except (OSError, UnicodeError, ValueError, pl.exceptions.PolarsError) as exc:
                report.errors.append(f"{name}: unreadable: {_first_line(exc)}")
                continue
            except (MemoryError, RecursionError) as exc:
                report.errors.append(f"{name}: too large or too deeply nested to analyse ({type(exc).__name__})")
                continue
            except Exception as exc:  # noqa: BLE001 - one bad file gets one line; the others are still analysed
                report.errors.append(f"{name}: could not be analysed: {type(exc).__name__}: {_first_line(exc)}")
                continue
            if kind is None:
                report.errors.append(f"{name}: format not recognised (not a kernel, training or NCCL log, dump, memory stats, scrape or NVML CSV)")
                continue
            if kind != "flight_recorder":
                report.read.append(name)
                report.formats[name] = kind
            self._place(path, name, report.findings[n_before:], report)
        for folder, dumps in fr_groups.items():
            names = [display(d) for d in dumps]
            bad: list[str] = []
            try:
                # A dump that cannot be loaded is named in `bad` and left out; the folder's other
                # ranks are still analysed together.
                from gpuvigil.offline.fr import analyze_paths

                found = analyze_paths(dumps, job=self.job, errors=bad, cfg=self.cfg)
            except UserError as exc:
                report.errors.append(_one_line(str(exc), ", ".join(names)))
                continue
            except Exception as exc:  # noqa: BLE001 - as for single files: one line, the rest goes on
                report.errors.append(f"{', '.join(names)}: could not be analysed: {type(exc).__name__}: {_first_line(exc)}")
                continue
            report.errors.extend(bad)
            names = [n for n, d in zip(names, dumps, strict=True) if not any(str(d) in b or n in b for b in bad)]
            report.findings.extend(found)
            for n in names:
                report.read.append(n)
                report.formats[n] = "flight_recorder"
        report.findings.sort(key=lambda f: (f.ts, SEVERITY_ORDER[f.severity], f.source or ""))
        return report

    def _analyze_file(self, path: Path, name: str, report: Report, fr_groups: dict[Path, list[Path]]) -> str | None:
        head = _head(path)
        if not head:
            raise UserError(f"{name}: empty file")
        if looks_like_pickle(head) or _is_json(head):
            kind = self._analyze_structured(path, name, head, report, fr_groups)
            if kind is not None:
                return kind
            # JSON that no reader claims falls through to the text checks (JSON-lines logs).
        if b"\x00" in head:
            return None
        text_head = head.decode("utf-8", errors="replace")
        ref = self.at if self.at is not None else _mtime(path)
        kinds = self._analyze_logs(path, name, head, text_head, ref, report)
        if kinds is None:
            return None  # a README or runbook quoting messages is not a log
        if kinds:
            return "+".join(kinds)
        return self._analyze_reading(path, name, text_head, ref, report)

    def _analyze_structured(self, path: Path, name: str, head: bytes, report: Report, fr_groups: dict[Path, list[Path]]) -> str | None:
        """A pickle or JSON file: a Flight Recorder dump (kept for its folder's cross-rank
        analysis), memory stats or a snapshot; a pickle that is neither is refused, saying why."""
        if self._is_fr(path):
            fr_groups.setdefault(path.parent, []).append(path)
            return "flight_recorder"
        if self.alloc is not None and (self.alloc.is_memory_stats(path) or self.alloc.is_snapshot(path)):
            kind = "memory_stats" if self.alloc.is_memory_stats(path) else "memory_snapshot"
            report.findings.extend(self._tag(memory_state_findings(path, cfg=self.cfg, source=str(path)), name))
            return kind
        if looks_like_pickle(head):
            from gpuvigil.collectors.safe_pickle import safe_load

            try:
                safe_load(path)  # says precisely why a malicious or broken pickle is refused
            except UserError as exc:
                reason = _first_line(exc).removeprefix(f"{path}: ")
                raise UserError(f"{name}: {reason}") from exc
            missing = [m for m, mod in (("Flight Recorder", self.fr), ("allocator", self.alloc)) if mod is None]
            why = f" (this install has no {' or '.join(missing)} reader)" if missing else ""
            raise UserError(f"{name}: pickle that is neither a Flight Recorder dump nor a memory snapshot{why}; not loaded")
        return None

    def _analyze_logs(self, path: Path, name: str, head: bytes, text_head: str, ref: float, report: Report) -> list[str] | None:
        """A kernel log and/or a training / NCCL log (one file may be both): the kinds found, or
        None for a prose document that only quotes log lines."""
        from gpuvigil.collectors import kernel_log
        from gpuvigil.parsers import nccl as nccl_text
        from gpuvigil.parsers import xid_line

        kinds: list[str] = []
        # Line by line: the XID pattern ends in `$`, which (without MULTILINE) only matched when
        # the XID line was the last line of the sample; dmesg has other lines after it.
        head_lines = text_head.splitlines(keepends=True)
        if len(head) == SNIFF_BYTES and head_lines:
            head_lines = head_lines[:-1]  # the last line may be cut by the sniff
        if is_prose_document(head_lines):
            return None
        xid_head = [ln for ln in log_lines(head_lines, xid_line.XID_LINE) if "Xid" in ln]
        # any XID wording, incl. the lost-GPU driver message without an Xid line (parsers.xid_line)
        if (
            any(xid_line.XID_LINE.search(ln.rstrip("\r\n")) for ln in xid_head)
            or xid_line.looks_like_kernel_log("".join(log_lines(head_lines, xid_line.XID_LINE)))
            or (len(head) == SNIFF_BYTES and _grep(path, b"NVRM: Xid", b"fallen off the bus"))
        ):
            cfg = kernel_log.load_config(self.cfg)
            lines = kernel_log.parse_lines(log_lines(_text_lines(path), xid_line.XID_LINE), node=self.node, pci_to_gpu=self.pci_to_gpu, reference_ts=ref)
            incidents = kernel_log.incident_rows(lines, cfg.burst_gap_seconds, ts=ref, file=name, job=self.job)
            report.findings.extend(detect_once(["xid_incidents"], {"xid_incidents": incidents}, ref, self.cfg))
            kinds.append("kernel_log")
        if nccl_text.looks_like_training_log("".join(log_lines(head_lines, nccl_text._SNIFF))) or (
            len(head) == SNIFF_BYTES and _grep(path, b"Watchdog caught", b"CUDA out of memory", b"HIP out of memory", b"NCCL WARN", b"NCCL error")
        ):
            parsed = nccl_text.parse_lines(log_lines(_text_lines(path), nccl_text._SNIFF), reference_ts=ref)
            report.findings.extend(training_log_findings(parsed, source_file=name, job=self.job, node=self.node, cfg=self.cfg))
            kinds.append("training_log")
        return kinds

    def _analyze_reading(self, path: Path, name: str, text_head: str, ref: float, report: Report) -> str | None:
        """One saved reading of a node: an NVML CSV, a dcgm-exporter or gpuvigil scrape, or
        `nvidia-smi -q` output."""
        from gpuvigil.collectors import dcgm
        from gpuvigil.parsers import nvidia_smi

        if _is_nvml_csv(text_head):
            _check_size(path, name, MAX_TABLE_BYTES, "an NVML CSV")
            report.findings.extend(self._tag(analyze_nvml_csv(path, name, self.node, self.cfg), name))
            return "nvml_csv"
        if _is_prometheus(text_head):
            _check_size(path, name, MAX_SCRAPE_BYTES, "a saved /metrics scrape")
            text = path.read_text(errors="replace")
            if dcgm.looks_like_dcgm_scrape(text):
                samples, _w, _e = dcgm.read_scrape(path, ts=ref, default_node=self.node)
                found = scrape_findings(samples, nvidia_smi.xid_counter_samples(text), ref, node=self.node, cfg=self.cfg, source=name)
                report.findings.extend(self._tag(found, name))
                return "dcgm_scrape"
            if "gpuvigil_" in text:
                try:
                    report.findings.extend(findings_from_gpuvigil_scrape(text, name, ref, self.cfg))
                except ValueError as exc:
                    raise UserError(f"{name}: not a Prometheus text exposition: {_first_line(exc)}") from exc
                return "gpuvigil_scrape"
        if nvidia_smi.looks_like_nvidia_smi_q(text_head):
            text = path.read_text(errors="replace")
            report.findings.extend(smi_findings(text, source_file=name, ts=ref, node=self.node, cfg=self.cfg))
            return "nvidia_smi_q"
        return None

    def _analyze_sysfs(self, tree: Path, name: str, report: Report) -> None:
        """A sysfs tree's InfiniBand/RoCE ports, read once: ports below their expected or their
        peers' rate, and (with detectors.infiniband.expected_ports) ports down or missing."""
        from gpuvigil.collectors.infiniband import InfinibandCollector

        ref = self.at if self.at is not None else time.time()
        ports = InfinibandCollector(tree, node=self.node or "sysfs").read(ref)
        report.findings.extend(self._tag(detect_once(["infiniband"], {"ib_ports": ports}, ref, self.cfg), name))
        report.read.append(name)
        report.formats[name] = "sysfs"
        report.placed[name] = (ref, "--at" if self.at is not None else "time of reading")

    def _place(self, path: Path, name: str, found: list[Finding], report: Report) -> None:
        """Findings of `path` that carry no time of their own got the file's modification time
        (or --at, where the reader was handed it): moved to --at when given, and recorded, so
        that a report can say which inputs were placed where."""
        try:
            mtime = _mtime(path)
        except OSError:
            return
        ref = self.at if self.at is not None else mtime
        for f in found:
            if f.ts == mtime or f.ts == ref:
                f.ts = ref
                report.placed[name] = (ref, "--at" if self.at is not None else "file time")

    def _tag(self, found: list[Finding], name: str) -> list[Finding]:
        for f in found:
            if f.job is None and self.job:
                f.job = self.job
            if f.node is None and self.node:
                f.node = self.node
            if not f.source:
                f.source = name
        return found


def memory_state_findings(path: str | Path, *, job: str | None = None, node: str | None = None, gpu: int | None = None,
                          cfg: dict[str, Any] | None = None, source: str | None = None) -> list[Finding]:
    """Findings for one memory_stats JSON or snapshot pickle (`UserError` for anything else): read
    by the allocator reader into an `allocator_readings` row, judged by the registered
    `allocator_state` detector. `source`: the file's name in the findings (default: `path`)."""
    from gpuvigil.collectors import allocator
    from gpuvigil.detectors import allocator_state

    p = Path(path)
    name = str(p) if source is None else source
    try:
        ts = p.stat().st_mtime
    except OSError as exc:
        raise UserError(f"{p}: cannot read: {exc.strerror or exc}") from exc
    with p.open("rb") as fh:
        head = fh.read(16)
    if looks_like_pickle(head):
        snap = allocator.read_snapshot(p, allocator_state.load_config(cfg).recurring_min_count)
        snap.source = name
        row = allocator.snapshot_reading(snap, ts=ts, job=job, node=node, gpu=gpu)
    else:
        row = allocator.stats_reading(allocator.read_memory_stats(p), name, ts=ts, job=job, node=node, gpu=gpu)
    return detect_once(["allocator_state"], {"allocator_readings": allocator.readings_frame([row], str(p))}, ts, cfg)


def kernel_log_findings(
    text: str,
    *,
    source_file: str | None = None,
    node: str | None = None,
    pci_to_gpu: dict[str, int] | None = None,
    reference_ts: float | None = None,
    cfg: dict[str, Any] | None = None,
) -> list[Finding]:
    """The `xid` findings of a kernel log's text: its lines read and grouped into incidents (the
    `xid_incidents` stream) by the kernel-log reader, judged by the registered `xid_incidents`
    detector."""
    from gpuvigil.collectors import kernel_log

    ref = time.time() if reference_ts is None else reference_ts
    lines = kernel_log.parse_lines(text.splitlines(), node=node, pci_to_gpu=pci_to_gpu, reference_ts=ref)
    incidents = kernel_log.incident_rows(lines, kernel_log.load_config(cfg).burst_gap_seconds, ts=ref, file=source_file)
    return detect_once(["xid_incidents"], {"xid_incidents": incidents}, ref, cfg)


# The registered detectors that judge a training / NCCL log's events, online and here alike.
TRAINING_LOG_DETECTORS = ("watchdog", "nccl_error", "oom_events")
# Which events a finding of each kind was built from (to name the first line in its source).
_EVENT_KINDS = {FindingKind.NCCL_TIMEOUT: "nccl_timeout", FindingKind.NCCL_ERROR: "nccl_error"}


def training_log_findings(
    log: Any,
    *,
    source_file: str | None = None,
    job: str | None = None,
    node: str | None = None,
    reference_ts: float | None = None,
    cfg: dict[str, Any] | None = None,
) -> list[Finding]:
    """The `nccl_timeout`, `nccl_error` and `oom_*` findings of a whole training / NCCL log (its
    text, or its `parsers.nccl.ParsedLog`): its lines turned into `events` by the log collector
    and judged by the registered detectors serve runs (TRAINING_LOG_DETECTORS), so a log gets the
    same answer offline and live. Each finding's source is the log's `file:line` of its first
    line."""
    from gpuvigil.collectors import nccl_log

    parsed = nccl_log.parse_lines(log.splitlines(), reference_ts=reference_ts) if isinstance(log, str) else log
    node = node or (parsed.hosts.most_common(1)[0][0] if len(parsed.hosts) == 1 else None)
    events = nccl_log.events(parsed, node=node, job=job, file=source_file)
    if events.height == 0:
        return []
    # Live, the detectors judge what arrived in their last minutes; a log read afterwards spans
    # any time, and all of it is evidence. One tick at the log's last line, with a history and
    # report windows (and XID/network lookbacks) that reach back to its first line, sees it whole.
    first, last = float(events["ts"].min()), float(events["ts"].max())
    span = last - first + 1.0
    judged = config.defaults() if cfg is None else copy.deepcopy(cfg)
    blocks = judged.setdefault("detectors", {})
    for name in ("watchdog", "nccl_error"):
        blocks[name] = {**(blocks.get(name) or {}), "report_seconds": span, "hardware_lookback_seconds": span}
    blocks["oom_events"] = {**(blocks.get("oom_events") or {}), "report_seconds": span}
    found = detect_once(TRAINING_LOG_DETECTORS, {"events": events}, last, judged, horizon=span)
    for f in found:
        # Live, a job's software fault names no node (nothing on a node to act on); the one
        # reading a log afterwards was told (--node) or the log says where it ran, as for every
        # other file analyze reads.
        f.node = f.node or node
        if source_file:
            f.source = f"{source_file}:{_first_line_of(parsed, f)}"
    return found


def _first_line_of(parsed: Any, f: Finding) -> int:
    """The line of the first record a finding was built from: of its kind, at its first time,
    one of its ranks where it names any (an OOM: the same GPU and request)."""
    kind = _EVENT_KINDS.get(f.kind, "oom")
    records = {
        "nccl_timeout": [(t.line, t.ts, t.rank, None) for t in parsed.timeouts] + [(*r, None) for r in parsed.some_failed + parsed.timeout_at],
        "nccl_error": [(e.line, e.ts, e.rank, None) for e in parsed.errors],
        "oom": [(o.line, o.ts, o.rank, (o.gpu, o.requested_bytes)) for o in parsed.ooms],
    }[kind]
    first_ts = f.evidence.get("first_ts", f.ts)
    same = (f.gpu, f.evidence.get("requested_bytes")) if kind == "oom" else None
    ranked = [r for r in records if r[1] == first_ts and (not f.ranks or r[2] in f.ranks) and r[3] == same]
    return min(ranked or [r for r in records if r[1] == first_ts] or records)[0]


def _grep(path: Path, *needles: bytes) -> bool:
    """Whether a large file contains any of `needles` beyond its sniffed head (streamed)."""
    keep = max(len(n) for n in needles)
    tail = b""
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            buf = tail + chunk
            if any(n in buf for n in needles):
                return True
            tail = buf[-keep:]
    return False


def _check_size(path: Path, name: str, limit: int, what: str) -> None:
    size = path.stat().st_size
    if size > limit:
        raise UserError(f"{name}: {size} bytes is more than the {limit}-byte limit for {what}; not loaded")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _one_line(msg: str, name: str) -> str:
    line = msg.strip().splitlines()[0] if msg.strip() else "unreadable"
    return line if name in line else f"{name}: {line}"


def action_of(finding: Finding, policy: Any) -> str | None:
    """What to do: NVIDIA's immediate action for an XID, else the scheduler hints' actions."""
    if finding.kind == FindingKind.XID:
        act = finding.evidence.get("action")
        return str(act) if act else None
    rule = policy.rule_for(finding)
    if rule is None or not rule.actions:
        return None
    return ", ".join(a.value for a in rule.actions)


def to_json_line(finding: Finding, policy: Any) -> dict[str, Any]:
    d = finding.to_json_dict()
    return {
        "kind": d["kind"],
        "severity": d["severity"],
        "ts": d["ts"],
        "job": d["job"],
        "ranks": d["ranks"],
        "culprit_ranks": d["culprit_ranks"],
        "node": d["node"],
        "gpu": d["gpu"],
        "xid": d["xid"],
        "action": action_of(finding, policy),
        "cause": d["cause"],
        "evidence": {k: _cut(v) for k, v in d["evidence"].items()},
        "summary": _cut(d["summary"]),
        "source": d["source"],
        "id": d["id"],
    }


def _cut(value: Any) -> Any:
    """Long text from a file (a runaway log message) cut to MAX_MESSAGE_CHARS, saying so."""
    if isinstance(value, str) and len(value) > MAX_MESSAGE_CHARS:
        return value[:MAX_MESSAGE_CHARS] + f"… ({len(value) - MAX_MESSAGE_CHARS} more characters not shown)"
    return value


def _fmt_ts(ts: float) -> str:
    # Since-boot dmesg stamps are small numbers: print them as such, not as 1970 dates.
    if ts < 10 * 365 * 86400:
        return f"{ts:.3f} s since boot"
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _fmt_value(v: Any, key: str = "") -> str:
    if key.endswith("_ts") and isinstance(v, (int, float)):
        return _fmt_ts(float(v))
    if isinstance(v, float):
        return f"{v:.6g}"
    if isinstance(v, (list, dict)):
        return json.dumps(v, sort_keys=True)
    return str(v)


def format_text(finding: Finding, policy: Any) -> str:
    """A readable block. Everything that came from a file goes through `printable`: escape
    sequences are removed and control characters shown as escapes, so a log line cannot drive the
    reader's terminal."""
    t = printable
    lines = [f"[{finding.severity.value.upper()}] {finding.kind.value}  {_fmt_ts(finding.ts)}  {t(finding.source or '', 300)}".rstrip()]
    lines.append(f"  {t(finding.summary, MAX_MESSAGE_CHARS)}")
    where = []
    for label, value in (("job", finding.job), ("node", finding.node), ("gpu", finding.gpu), ("xid", finding.xid)):
        if value is not None:
            where.append(f"{label} {t(value, 200)}")
    if finding.ranks:
        where.append(f"ranks {','.join(map(str, finding.ranks))}")
    if finding.culprit_ranks:
        where.append(f"culprit ranks {','.join(map(str, finding.culprit_ranks))}")
    if finding.cause:
        where.append(f"cause {t(finding.cause, 200)}")
    if where:
        lines.append("  " + "; ".join(where))
    act = action_of(finding, policy)
    if act:
        lines.append(f"  action: {t(act, 500)}")
    ev = ", ".join(f"{t(k, 100)}={t(_fmt_value(v, k), 500)}" for k, v in finding.evidence.items() if v is not None and v != [] and k != "message")
    if ev:
        lines.append(f"  evidence: {ev}")
    if finding.evidence.get("message"):
        lines.append(f"  message: {t(finding.evidence['message'], MAX_MESSAGE_CHARS)}")
    return "\n".join(lines)


def _parse_pci_map(items: list[str] | None) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items or []:
        for part in item.split(","):
            if not part.strip():
                continue
            bus, sep, idx = part.partition("=")
            if not sep or not bus.strip() or not idx.strip().isdigit():
                raise UserError(f"--pci-map: expected BUS_ID=GPU_INDEX (e.g. 0000:3b:00=3), got {part!r}")
            out[bus.strip()] = int(idx)
    return out


def handler(args: argparse.Namespace) -> int:
    try:
        cfg = config.load(args.config) if args.config else None
    except config.ConfigError as exc:
        raise UserError(str(exc)) from exc
    at = None
    if getattr(args, "at", None):
        at = parse_time(args.at)
    analyzer = Analyzer(cfg=cfg, job=args.job, node=args.node, pci_to_gpu=_parse_pci_map(args.pci_map), at=at)
    report = analyzer.run([Path(p) for p in args.paths])
    from gpuvigil.pipeline.hints import HintPolicy

    policy = HintPolicy(cfg)
    for err in report.errors:
        print(f"gpuvigil analyze: {printable(err, 1000)}", file=sys.stderr)
    if not report.read:
        raise UserError("nothing could be read" + (f" ({len(report.errors)} error(s) above)" if report.errors else ""))
    out = sys.stdout
    if args.format == "json":
        for f in report.findings:
            out.write(json.dumps(to_json_line(f, policy), sort_keys=False, default=str) + "\n")
    else:
        blocks = [format_text(f, policy) for f in report.findings]
        if blocks:
            out.write("\n\n".join(blocks) + "\n")
        n_page = sum(f.severity == Severity.PAGE for f in report.findings)
        out.write(
            f"\n{len(report.findings)} finding(s) ({n_page} page) from {len(report.read)} file(s)"
            + (f"; {len(report.errors)} file(s) skipped (see stderr)" if report.errors else "")
            + "\n"
        )
    out.flush()
    if getattr(args, "report", None):
        from gpuvigil.offline import report as html_report

        html_report.write_analyze_report(report, [Path(p) for p in args.paths], Path(args.report), cfg, node=args.node)
        print(f"gpuvigil analyze: report written to {args.report}", file=sys.stderr)
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "analyze",
        help="diagnose logs, dumps and scrapes offline (format detected from content)",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    p.add_argument("paths", nargs="+", metavar="PATH", help="files or folders: kernel/training/NCCL logs, Flight Recorder dumps, memory stats/snapshots, /metrics scrapes, NVML CSV")
    p.add_argument("--format", choices=["text", "json"], default="text", help="text blocks (default) or JSON lines")
    p.add_argument("--job", help="job name to attach to findings that do not name one")
    p.add_argument("--node", help="node name for logs that do not name their host")
    p.add_argument("--pci-map", action="append", metavar="BUS=GPU", help="map PCI bus ids in XID lines to GPU indices, e.g. 0000:3b:00=3 (repeatable, comma separated)")
    p.add_argument("--config", help="YAML/JSON config overriding thresholds (e.g. oom_classify)")
    p.add_argument("--report", metavar="FILE.html", help="also write a self-contained HTML incident report with plots (needs gpuvigil[report])")
    p.add_argument("--at", metavar="TIME", help="place inputs with no timestamps of their own at TIME (ISO 8601 or unix seconds); default: each file's modification time")
    p.set_defaults(func=handler)


__all__ = ["Analyzer", "Report", "add_parser", "format_text", "to_json_line", "analyze_nvml_csv", "scrape_findings", "smi_findings"]
