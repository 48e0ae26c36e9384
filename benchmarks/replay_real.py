"""`gpuvigil bench replay-real`: L0 detectors replayed over REAL per-pod GPU memory series with
seeded leaks, served by a real Prometheus, against the alert rules Prometheus users write.

Data: the per-pod GPU memory and duty-cycle series of Alibaba's cluster-trace-v2026-GenAI
(github.com/alibaba/clusterdata, `cluster-trace-v2026-GenAI`; "for research or study purpose"),
72 inference pods, ~22.8 h at a 57 s step (values scaled, timestamps shifted by the publisher).
No pod of the trace is known to have run out of memory: leaks are seeded on top of the real
series of some pods (a linear growth that brings the pod's usual peak to capacity within 20-60
min, or over hours), the other pods are left as they are (healthy).

Pipeline: the series become dcgm-exporter's series (`DCGM_FI_DEV_FB_USED`, `DCGM_FI_DEV_FB_FREE`
in MiB, `DCGM_FI_DEV_GPU_UTIL` from the duty cycle; labels `Hostname`, `gpu`, `UUID`, `pod`,
`namespace`, `container`), written as OpenMetrics, backfilled into a TSDB with `promtool tsdb
create-blocks-from openmetrics`, served by `prometheus` on a loopback port, and replayed with
`gpuvigil replay --prometheus` (every detector, the findings' lifecycle). The two usual alert
rules are evaluated by querying the same Prometheus:

- `predict_linear(DCGM_FI_DEV_FB_USED[30m], 15m) > capacity` for 5m;
- `DCGM_FI_DEV_FB_USED / capacity > 0.95` for 1m.

Scored per leak: warned (first page at least 60 s before the OOM and after the leak began), the
lead (OOM − first page); per healthy pod: paged at all (false page). Also the hang and straggler
L0 detectors' pages per GPU-day on the healthy pods.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

GIB = float(1 << 30)
MIB = float(1 << 20)
# The public traces beside the repository (shared/traces/, see its README); --trace overrides.
DEFAULT_TRACE = Path(__file__).resolve().parent.parent.parent / "shared" / "traces" / "alibaba-genai-2026"
MEMORY_FILE = "pod_gpu_memory_used_bytes_anon.csv.gz"
DUTY_FILE = "pod_gpu_duty_cycle_anon.csv.gz"
NAMESPACE = "genai-inference"


@dataclass
class Leak:
    pod: str
    kind: str  # "fast" (20-60 min) or "slow" (hours)
    start: float  # the leak's first byte
    oom: float  # the first sample at capacity (the pod's series ends there)
    rate: float  # bytes a second


def read_trace(directory: Path) -> tuple[pl.DataFrame, pl.DataFrame]:
    """(memory, duty) long frames: pod, ts, value (bytes; duty cycle in %), sorted."""
    mem = pl.read_csv(directory / MEMORY_FILE).select(pl.col("container_ip").alias("pod"), pl.col("timestamp_anon").alias("ts"), pl.col("value").cast(pl.Float64))
    duty_path = directory / DUTY_FILE
    duty = (
        pl.read_csv(duty_path).select(pl.col("container_ip").alias("pod"), pl.col("timestamp_anon").alias("ts"), pl.col("value").cast(pl.Float64))
        if duty_path.exists()
        else pl.DataFrame(schema={"pod": pl.Utf8, "ts": pl.Float64, "value": pl.Float64})
    )
    return mem.sort("pod", "ts"), duty.sort("pod", "ts")


def add_leak(ts: np.ndarray, used: np.ndarray, start: float, duration: float, capacity: float) -> tuple[np.ndarray, np.ndarray, float, float]:
    """A linear leak from `start` on top of a real series: its rate brings the series' usual peak
    (95th percentile of the hour before the leak, else of the whole series) to capacity in
    `duration` s. The series ends at its first sample at capacity (the OOM; that sample reads
    capacity). Returns (ts, used, oom ts (inf: none), rate in bytes/s)."""
    before = used[(ts >= start - 3600) & (ts < start)]
    peak = float(np.percentile(before if before.size else used, 95))
    rate = (capacity - peak) / duration
    leaked = used + rate * np.clip(ts - start, 0, None)
    over = np.flatnonzero(leaked >= capacity)
    if not over.size:
        return ts, leaked, math.inf, rate
    end = int(over[0])
    return ts[: end + 1], np.minimum(leaked[: end + 1], capacity), float(ts[end]), rate


def seed_leaks(
    mem: pl.DataFrame,
    capacity: float,
    *,
    fast: int = 8,
    slow: int = 4,
    seed: int = 0,
    fast_minutes: tuple[float, float] = (20.0, 60.0),
    slow_hours: tuple[float, float] = (2.0, 5.0),
    history_seconds: float = 7200.0,
    min_samples: int = 1000,
) -> tuple[pl.DataFrame, list[Leak]]:
    """Add a linear leak to `fast` + `slow` pods (chosen at random among those with at least
    `min_samples` samples), on top of their real series. The leak starts after `history_seconds`
    of the pod's life and grows at the rate that brings the pod's usual peak (95th percentile of
    the hour before) to capacity in its duration; the pod runs out of memory at its first sample at
    capacity, which is its last. The other pods are left as they are."""
    rng = np.random.default_rng(seed)
    counts = mem.group_by("pod").len().filter(pl.col("len") >= min_samples).sort("pod")["pod"].to_list()
    chosen = rng.choice(counts, size=min(fast + slow, len(counts)), replace=False).tolist()
    leaks: list[Leak] = []
    parts = [mem.filter(~pl.col("pod").is_in(chosen))]
    for i, pod in enumerate(chosen):
        kind = "fast" if i < fast else "slow"
        s = mem.filter(pl.col("pod") == pod)
        ts, v = s["ts"].to_numpy(), s["value"].to_numpy()
        dur = rng.uniform(*fast_minutes) * 60 if kind == "fast" else rng.uniform(*slow_hours) * 3600
        lo, hi = ts[0] + history_seconds, ts[-1] - dur - 600
        if hi <= lo:
            dur = max(ts[-1] - 600 - lo, 1200.0)
            hi = lo + 1
        start = float(rng.uniform(lo, hi))
        ts, leaked, oom, rate = add_leak(ts, v, start, dur, capacity)
        leaks.append(Leak(pod, kind, start, oom, rate))
        parts.append(pl.DataFrame({"pod": pod, "ts": ts, "value": leaked}))
    return pl.concat(parts).sort("pod", "ts"), leaks


# -- dcgm-exporter series -------------------------------------------------------------------------
def placement(pods: list[str], group: int = 1) -> dict[str, dict[str, str]]:
    """dcgm-exporter's labels of each pod's GPU: one GPU a pod, 8 GPUs a host (the trace names no
    host; the pods are placed in sorted order). `group` > 1: that many GPUs (series) a pod, as
    a multi-GPU job's pod shows (a constructed grouping: the trace's pods have one GPU each)."""
    out = {}
    for i, pod in enumerate(sorted(pods)):
        out[pod] = {
            "Hostname": f"genai-node-{i // 8:02d}",
            "gpu": str(i % 8),
            "UUID": f"GPU-{pod[:8]}-{pod[8:12]}-{pod[12:16]}-{pod[16:20]}-{pod[20:32]}",
            "pod": f"infer-{pod}" if group == 1 else f"infer-group-{i // group:02d}",
            "namespace": NAMESPACE,
            "container": "server",
        }
    return out


def write_openmetrics(mem: pl.DataFrame, duty: pl.DataFrame, capacity: float, path: Path, group: int = 1) -> dict[str, dict[str, str]]:
    """The series as dcgm-exporter exposes them (FB_USED/FB_FREE in MiB, GPU_UTIL in %), with
    sample timestamps, as OpenMetrics text for `promtool tsdb create-blocks-from openmetrics`."""
    where = placement(mem["pod"].unique().to_list(), group)
    labels = pl.DataFrame([{"pod_id": p, "labels": "{" + ",".join(f'{k}="{v}"' for k, v in lab.items()) + "}"} for p, lab in where.items()])
    used_mib = (pl.col("value") / MIB).round(0)
    families = [
        ("DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB).", mem.with_columns(used_mib.alias("v"))),
        ("DCGM_FI_DEV_FB_FREE", "Framebuffer memory free (in MiB).", mem.with_columns((round(capacity / MIB) - used_mib).alias("v"))),
        ("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %).", duty.join(mem.group_by("pod").agg(pl.col("ts").max().alias("_end")), on="pod").filter(pl.col("ts") <= pl.col("_end")).with_columns(pl.col("value").round(0).alias("v"))),
    ]
    with path.open("w") as fh:
        for name, text, df in families:
            if df.height == 0:  # no samples (a trace without its duty-cycle file): no family, since an empty one is no valid OpenMetrics
                continue
            fh.write(f"# HELP {name} {text}\n# TYPE {name} gauge\n")
            lines = df.join(labels, left_on="pod", right_on="pod_id").sort("pod", "ts").select(
                pl.format("{}{} {} {}", pl.lit(name), pl.col("labels"), pl.col("v").cast(pl.Int64), pl.col("ts").cast(pl.Int64))
            )
            fh.write("\n".join(lines.to_series().to_list()) + "\n")
        fh.write("# EOF\n")
    return where


class Prometheus:
    """A real Prometheus over a TSDB backfilled from OpenMetrics, on a loopback port."""

    def __init__(self, openmetrics: Path, workdir: Path):
        self.workdir = workdir
        data = workdir / "data"
        subprocess.run([_binary("promtool"), "tsdb", "create-blocks-from", "openmetrics", str(openmetrics), str(data)], check=True, capture_output=True, timeout=600)
        (workdir / "prometheus.yml").write_text("global:\n  scrape_interval: 1m\nscrape_configs: []\n")
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = (workdir / "prometheus.log").open("w")
        self.proc = subprocess.Popen(
            [_binary("prometheus"), f"--config.file={workdir / 'prometheus.yml'}", f"--storage.tsdb.path={data}", f"--web.listen-address=127.0.0.1:{self.port}",
             "--storage.tsdb.retention.time=20y", "--log.level=warn"],
            stdout=self.log, stderr=subprocess.STDOUT, cwd=workdir,
        )
        import httpx

        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{self.url}/-/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"prometheus did not start: {(workdir / 'prometheus.log').read_text()[-2000:]}")
            time.sleep(0.3)

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        import httpx

        r = httpx.get(f"{self.url}/api/v1/query_range", params={"query": expr, "start": start, "end": end, "step": step}, timeout=120)
        if r.status_code != 200:
            raise RuntimeError(f"prometheus refused {expr!r}: {r.text[:500]}")
        return r.json()["data"]["result"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        self.log.close()


def _binary(name: str) -> str:
    found = shutil.which(name) or (f"/usr/bin/{name}" if Path(f"/usr/bin/{name}").exists() else None)
    if not found:
        raise SystemExit(f"bench replay-real: `{name}` is not installed (Debian package prometheus)")
    return found


RULES = {
    "predict_linear": ("predict_linear(DCGM_FI_DEV_FB_USED[30m], 900) > (DCGM_FI_DEV_FB_USED + DCGM_FI_DEV_FB_FREE)", 300.0),
    "used_over_95pct": ("DCGM_FI_DEV_FB_USED / (DCGM_FI_DEV_FB_USED + DCGM_FI_DEV_FB_FREE) > 0.95", 60.0),
}


def rule_fires(prom: Prometheus, expr: str, hold: float, start: float, end: float, every: float = 60.0) -> dict[str, list[float]]:
    """When an alerting rule `expr` with `for: hold` would fire, evaluated every `every` seconds
    (Prometheus' evaluation_interval) over [start, end]: per pod label, the times it went firing
    (true at every evaluation for `hold` seconds since it went pending)."""
    out: dict[str, list[float]] = {}
    chunk = 10_000 * every
    t = start
    while t <= end:
        hi = min(end, t + chunk - every)
        for series in prom.query_range(expr, t, hi, every):
            pod = series["metric"].get("pod", "")
            times = sorted(float(x[0]) for x in series["values"])
            fired, pending, prev = out.setdefault(pod, []), None, None
            for ts in times:
                if prev is None or ts - prev > every * 1.5:
                    pending = ts
                if ts - pending >= hold and (not fired or fired[-1] < pending):
                    fired.append(ts)
                prev = ts
        t = hi + every
    return out


# -- scoring --------------------------------------------------------------------------------------
def score(pages: dict[str, list[float]], leaks: list[Leak], pods: list[str], min_lead: float = 60.0) -> dict[str, Any]:
    """Per leak: the first page after it began and its lead to the OOM (warned: at least
    `min_lead` s ahead). Per pod: a page on a healthy pod, or on a leaking pod before its leak
    began, is a false page."""
    by_pod = {lk.pod: lk for lk in leaks}
    leads, per_leak, false_pods = [], [], []
    for pod in pods:
        times = sorted(pages.get(pod, []))
        lk = by_pod.get(pod)
        if lk is None:
            if times:
                false_pods.append(pod)
            continue
        if any(t < lk.start for t in times):
            false_pods.append(pod)
        after = [t for t in times if lk.start <= t <= lk.oom]
        lead = lk.oom - after[0] if after else None
        per_leak.append({"pod": pod, "kind": lk.kind, "minutes": round((lk.oom - lk.start) / 60, 1), "lead_s": lead})
        if lead is not None and lead >= min_lead:
            leads.append(lead)
    return {
        "warned": len(leads),
        "leaks": len(leaks),
        "median_lead_s": float(np.median(leads)) if leads else None,
        "false_pages": len(false_pods),
        "healthy": len(pods) - len(leaks),
        "per_leak": per_leak,
    }


def gpuvigil_replay(url: str, start: float, end: float, step: float, config_path: Path | None = None) -> list[dict[str, Any]]:
    """`gpuvigil replay --prometheus` as a user runs it: its JSON lines."""
    cmd = [sys.executable, "-m", "gpuvigil", "replay", "--prometheus", url, "--start", f"{start:.0f}", "--end", f"{end:.0f}", "--step", f"{step:g}s", "--format", "json"]
    if config_path is not None:
        cmd += ["--config", str(config_path)]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"gpuvigil replay failed ({done.returncode}): {done.stderr[-2000:]}")
    return [json.loads(line) for line in done.stdout.splitlines() if line.strip()]


def run(trace: Path, capacity_gib: float = 80.0, seed: int = 0, fast: int = 8, slow: int = 4, step: float = 57.0, group: int = 8) -> dict[str, Any]:
    capacity = capacity_gib * GIB
    mem, duty = read_trace(trace)
    leaked, leaks = seed_leaks(mem, capacity, fast=fast, slow=slow, seed=seed)
    pods = sorted(leaked["pod"].unique().to_list())
    start, end = float(leaked["ts"].min()), float(leaked["ts"].max())
    with tempfile.TemporaryDirectory(prefix="gpuvigil-replay-real-") as tmp:
        work = Path(tmp)
        where = write_openmetrics(leaked, duty, capacity, work / "dcgm.om")
        label_to_pod = {lab["pod"]: pod for pod, lab in where.items()}
        gpu_to_pod = {(lab["Hostname"], int(lab["gpu"])): pod for pod, lab in where.items()}
        t0 = time.perf_counter()
        prom = Prometheus(work / "dcgm.om", work / "prom")
        try:
            backfill_s = time.perf_counter() - t0
            rules = {}
            for name, (expr, hold) in RULES.items():
                fires = rule_fires(prom, expr, hold, start, end + 900)
                rules[name] = score({label_to_pod[k]: v for k, v in fires.items() if k in label_to_pod}, leaks, pods)
            t1 = time.perf_counter()
            records = gpuvigil_replay(prom.url, start, end, step)
            replay_s = time.perf_counter() - t1
        finally:
            prom.stop()
    findings = [r for r in records if r.get("record") == "finding"]
    summary = next((r for r in records if r.get("record") == "summary"), {})

    def pod_of(r: dict[str, Any]) -> str | None:
        return gpu_to_pod.get((r.get("node"), r.get("gpu"))) if r.get("gpu") is not None else None

    oom_pages: dict[str, list[float]] = {}
    for r in findings:
        if r["kind"] == "oom_predicted" and r["severity"] == "page" and (pod := pod_of(r)) is not None:
            oom_pages.setdefault(pod, []).append(float(r["fired_at"]))
    ours = score(oom_pages, leaks, pods)
    ours["false_tickets"] = len({pod_of(r) for r in findings if r["kind"] == "oom_predicted" and r["severity"] != "page" and pod_of(r) not in {lk.pod for lk in leaks}} - {None})
    healthy = [p for p in pods if p not in {lk.pod for lk in leaks}]
    spans = leaked.filter(pl.col("pod").is_in(healthy)).group_by("pod").agg((pl.col("ts").max() - pl.col("ts").min()).alias("span"))
    gpu_days = float(spans["span"].sum()) / 86400
    other: dict[str, int] = {}
    for r in findings:
        if r["severity"] == "page" and r.get("source") in ("hang_device", "straggler_device") and pod_of(r) in healthy:
            other[r["source"]] = other.get(r["source"], 0) + 1
    # The hang and straggler detectors compare a job's GPUs (>= 2, >= 4): the same real series,
    # no leak, `group` GPUs a pod.
    grouped: dict[str, Any] = {}
    if group > 1:
        with tempfile.TemporaryDirectory(prefix="gpuvigil-replay-real-") as tmp:
            work = Path(tmp)
            write_openmetrics(mem, duty, capacity, work / "dcgm.om", group)
            prom = Prometheus(work / "dcgm.om", work / "prom")
            try:
                grecords = gpuvigil_replay(prom.url, float(mem["ts"].min()), float(mem["ts"].max()), step)
            finally:
                prom.stop()
        gdays = float(mem.group_by("pod").agg((pl.col("ts").max() - pl.col("ts").min()).alias("span"))["span"].sum()) / 86400
        gpages: dict[str, int] = {}
        for r in grecords:
            if r.get("record") == "finding" and r["severity"] == "page":
                src = r.get("source") or r["kind"]
                gpages[src] = gpages.get(src, 0) + 1
        grouped = {"group": group, "gpu_days": gdays, "pages": gpages, "pages_per_gpu_day": {s: gpages.get(s, 0) / gdays for s in ("hang_device", "straggler_device")}}
    paged: dict[str, set] = {}  # the GPUs each detector paged about (a finding that went quiet and came back counts once)
    for r in findings:
        if r["severity"] == "page":
            paged.setdefault(r.get("source") or r["kind"], set()).add((r.get("node"), r.get("gpu")))
    pages_by_source = {k: len(v) for k, v in paged.items()}
    return {
        "trace": str(trace),
        "pods": len(pods),
        "capacity_gib": capacity_gib,
        "seed": seed,
        "step_s": step,
        "start": start,
        "end": end,
        "leaks": [lk.__dict__ for lk in leaks],
        "gpuvigil": ours,
        "rules": rules,
        "healthy_gpu_days": gpu_days,
        "hang_straggler_pages": other,
        "hang_straggler_pages_per_gpu_day": {s: other.get(s, 0) / gpu_days for s in ("hang_device", "straggler_device")},
        "pages_by_source": pages_by_source,
        "grouped": grouped,
        "replay_summary": summary,
        "backfill_s": backfill_s,
        "replay_s": replay_s,
    }


def _met(ok: bool) -> str:
    return "met" if ok else "**not met**"


def markdown(res: dict[str, Any], command: str) -> str:
    g, pl_rule, pct = res["gpuvigil"], res["rules"]["predict_linear"], res["rules"]["used_over_95pct"]
    n_fast = sum(1 for lk in res["leaks"] if lk["kind"] == "fast")
    n_slow = len(res["leaks"]) - n_fast

    def lead(x: dict[str, Any]) -> str:
        return "-" if x["median_lead_s"] is None else f"{x['median_lead_s']:.0f} s"

    rows = [
        ("gpuvigil `oom_device` (L0, `gpuvigil replay --prometheus`)", g),
        ("`predict_linear(DCGM_FI_DEV_FB_USED[30m], 900) > (DCGM_FI_DEV_FB_USED + DCGM_FI_DEV_FB_FREE)` for 5m", pl_rule),
        ("`DCGM_FI_DEV_FB_USED / (DCGM_FI_DEV_FB_USED + DCGM_FI_DEV_FB_FREE) > 0.95` for 1m", pct),
    ]
    table = "| alerting | leaks warned >= 60 s ahead | median lead | healthy pods paged |\n|---|---:|---:|---:|\n" + "".join(
        f"| {name} | {x['warned']} / {x['leaks']} | {lead(x)} | {x['false_pages']} / {x['healthy']} |\n" for name, x in rows
    )
    gr = res.get("grouped") or {}
    hs = gr.get("pages_per_gpu_day") or res["hang_straggler_pages_per_gpu_day"]
    worst = max(hs.values()) if hs else 0.0
    targets = (
        "| target | measured | |\n|---|---|---|\n"
        f"| gpuvigil warns at least as many leaks as predict_linear | {g['warned']} vs {pl_rule['warned']} | {_met(g['warned'] >= pl_rule['warned'])} |\n"
        f"| gpuvigil median lead >= 600 s | {lead(g)} | {_met(g['median_lead_s'] is not None and g['median_lead_s'] >= 600)} |\n"
        f"| gpuvigil pages no healthy pod | {g['false_pages']} | {_met(g['false_pages'] == 0)} |\n"
        f"| hang and straggler L0 pages per GPU-day on healthy pods < 0.01 ({gr.get('group', 1)} GPUs a pod) | hang_device {hs['hang_device']:.4f}, straggler_device {hs['straggler_device']:.4f} | {_met(worst < 0.01)} |\n"
    )
    def secs(v: float | None) -> str:
        return "-" if v is None else f"{v:.0f}"

    per = "".join(
        f"| {x['pod'][:12]} | {x['kind']} | {x['minutes']:.0f} | {secs(x['lead_s'])} | {secs(y['lead_s'])} | {secs(z['lead_s'])} |\n"
        for x, y, z in zip(g["per_leak"], pl_rule["per_leak"], pct["per_leak"])
    )
    return (
        "## OOM ahead on real GPU memory series (`gpuvigil bench replay-real`)\n\n"
        f"Command: `{command}`\n\n"
        "Data: **real** per-pod GPU memory used and duty cycle of Alibaba's cluster-trace-v2026-GenAI "
        f"(github.com/alibaba/clusterdata; {res['pods']} inference pods, ~{(res['end'] - res['start']) / 3600:.1f} h, "
        f"**57 s resolution**, values as published), with **seeded leaks**: {n_fast} pods leak to OOM within 20-60 min and "
        f"{n_slow} over 2-5 h (a linear growth added to the real series, seed {res['seed']}), the other {g['healthy']} pods are left "
        f"as recorded. Capacity {res['capacity_gib']:g} GiB a GPU. Nothing here comes from the simulator. The series are served as "
        "dcgm-exporter's (`DCGM_FI_DEV_FB_USED`/`FB_FREE` in MiB, `DCGM_FI_DEV_GPU_UTIL`; labels `Hostname`, `gpu`, `UUID`, `pod`, "
        "`namespace`, `container`) by a real Prometheus (TSDB backfilled with `promtool tsdb create-blocks-from openmetrics`); "
        f"gpuvigil is `gpuvigil replay --prometheus` at a {res['step_s']:g} s step, the two rules are evaluated every 60 s by "
        "querying the same Prometheus (a rule's `for` as Prometheus applies it). A leak is warned when the first page comes after "
        "it began and at least 60 s before the OOM (lead = OOM - first page); a page on a healthy pod, or on a leaking pod before "
        "its leak, is a false page.\n\n"
        + table
        + f"\ngpuvigil's OOM tickets (not pages) on healthy pods: {g['false_tickets']}. GPUs paged about, per detector, in the whole replay "
        f"({res['pods']} GPUs, {len(res['leaks'])} of them leaking; {res['healthy_gpu_days']:.1f} healthy GPU-days): "
        + (", ".join(f"{k} {v}" for k, v in sorted(res["pages_by_source"].items())) or "none")
        + ".\n\n"
        + (
            f"Hang and straggler: the trace's pods have one GPU each, and `hang_device` compares >= 2 GPUs of a job, "
            f"`straggler_device` >= 4, so they are judged on a second replay of the same real series (no leak; memory and "
            f"duty cycle as `DCGM_FI_DEV_GPU_UTIL`; the trace has no power, clocks or link counters, so only the "
            f"utilisation signatures can show) with {gr['group']} GPUs a pod (a constructed grouping): "
            f"{', '.join(f'{k} {v}' for k, v in sorted(gr['pages'].items())) or 'no page'} over {gr['gpu_days']:.1f} GPU-days. "
            f"On the single-GPU pods of the first replay they paged {sum(res['hang_straggler_pages'].values())} times.\n\n"
            if gr else ""
        )
        + targets
        + "\nPer leak (lead in seconds; - = not warned):\n\n| pod | leak | minutes to OOM | gpuvigil | predict_linear | > 95% |\n|---|---|---:|---:|---:|---:|\n"
        + per
    )


def add_parser(sub) -> None:
    p = sub.add_parser("replay-real", help="OOM ahead on real GPU memory series with seeded leaks, via a real Prometheus, vs the usual alert rules")
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="directory of the Alibaba GenAI per-pod series (default: %(default)s)")
    p.add_argument("--capacity-gib", type=float, default=80.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fast", type=int, default=8, help="leaks to OOM within 20-60 min")
    p.add_argument("--slow", type=int, default=4, help="leaks over 2-5 h")
    p.add_argument("--step", type=float, default=57.0, help="replay tick and query step (s)")
    p.add_argument("--group", type=int, default=8, help="GPUs a pod in the hang/straggler replay (1: skip it)")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    p.add_argument("--no-write", action="store_true", help="do not write docs/benchmarks.md")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    res = run(args.trace, args.capacity_gib, args.seed, args.fast, args.slow, args.step, args.group)
    command = "gpuvigil bench replay-real" + "".join(
        f" --{k.replace('_', '-')} {v:g}" if isinstance(v, float) else f" --{k.replace('_', '-')} {v}"
        for k, v in (("capacity_gib", args.capacity_gib), ("seed", args.seed), ("fast", args.fast), ("slow", args.slow), ("step", args.step), ("group", args.group))
    )
    md = markdown(res, command)
    if not args.no_write:
        from benchmarks.report import write_section

        write_section("replay-real", md)
    print(json.dumps(res, indent=1, default=str) if args.json else md)
    return 0
