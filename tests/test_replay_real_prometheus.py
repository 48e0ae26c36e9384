"""`gpuvigil replay` against a real Prometheus holding real GPU memory series, as an operator
runs it after an incident.

Data: five real inference pods of Alibaba's cluster-trace-v2026-GenAI (57 s step; see
tests/data/public/alibaba-genai-2026/README.md), written as dcgm-exporter's series
(`DCGM_FI_DEV_FB_USED`/`FB_FREE` in MiB with `Hostname`, `gpu`, `UUID`, `pod`, `namespace`,
`container` labels), backfilled into a real Prometheus with promtool, then replayed by the CLI as
a process. One pod gets a 40-minute leak to OOM on top of its real noise (benchmarks/replay_real.py:
add_leak); the other four are left as recorded, with their bursts, restart and step.

What must hold: the job map comes from the pod labels, the leak is warned of (a ticket or a
page) at least 10 minutes before the OOM and paged once before it (not again on every 57 s
tick), and nothing pages about the healthy pods.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from benchmarks.replay_real import NAMESPACE, Prometheus, add_leak, gpuvigil_replay, write_openmetrics

DATA = Path(__file__).parent / "data" / "public" / "alibaba-genai-2026" / "pod_gpu_memory_used_bytes_excerpt.csv.gz"
CAPACITY = 80.0 * (1 << 30)
LEAKY = "00800b6d"  # typical 10-24 GiB swings; the leak rides on top of them
HOURS = 6.0


@pytest.fixture(scope="module")
def replayed(tmp_path_factory):
    for tool in ("prometheus", "promtool"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} not installed (Debian package prometheus; `make system-deps` installs it)")
    mem = pl.read_csv(DATA).select(pl.col("container_ip").alias("pod"), pl.col("timestamp_anon").alias("ts"), pl.col("value").cast(pl.Float64))
    t0 = mem["ts"].min()
    mem = mem.filter(pl.col("ts") < t0 + HOURS * 3600).sort("pod", "ts")
    (leaky,) = [p for p in mem["pod"].unique().to_list() if p.startswith(LEAKY)]
    s = mem.filter(pl.col("pod") == leaky)
    start = t0 + 3 * 3600
    ts, used, oom, _rate = add_leak(s["ts"].to_numpy(), s["value"].to_numpy(), start, 40 * 60, CAPACITY)
    assert np.isfinite(oom)
    # After the OOM the process dies and the pod restarts: its GPU holds ~1 GiB again, then its
    # recorded series (without the leak) goes on, as dcgm-exporter keeps reporting the GPU.
    after = s.filter(pl.col("ts") > oom)
    restarted = np.where(after["ts"].to_numpy() < oom + 600, float(1 << 30), after["value"].to_numpy())
    ts, used = np.concatenate([ts, after["ts"].to_numpy()]), np.concatenate([used, restarted])
    mem = pl.concat([mem.filter(pl.col("pod") != leaky), pl.DataFrame({"pod": leaky, "ts": ts, "value": used})]).sort("pod", "ts")
    work = tmp_path_factory.mktemp("prom")
    where = write_openmetrics(mem, pl.DataFrame(schema={"pod": pl.Utf8, "ts": pl.Float64, "value": pl.Float64}), CAPACITY, work / "series.om")
    prom = Prometheus(work / "series.om", work)
    try:
        findings = gpuvigil_replay(prom.url, t0, float(mem["ts"].max()), 57.0)
    finally:
        prom.stop()
    return {"findings": findings, "where": where, "leaky": leaky, "oom": oom, "start": start}


def _pod_of(finding: dict, where: dict) -> str | None:
    for pod, labels in where.items():
        if finding.get("node") == labels["Hostname"] and finding.get("gpu") == int(labels["gpu"]):
            return pod
    return None


def test_the_leak_is_paged_ten_minutes_before_the_oom_and_once(replayed):
    leaky, where = replayed["leaky"], replayed["where"]
    warned = [f for f in replayed["findings"] if f.get("kind") == "oom_predicted" and _pod_of(f, where) == leaky]
    assert warned, [(f.get("kind"), f.get("node"), f.get("gpu")) for f in replayed["findings"]]
    first = min(f["ts"] for f in warned)
    assert replayed["start"] < first <= replayed["oom"] - 600, (first - replayed["start"], replayed["oom"] - first)
    pages = [f for f in warned if f.get("severity") == "page"]
    assert pages and min(p["ts"] for p in pages) < replayed["oom"], [(f["ts"] - replayed["oom"], f["severity"]) for f in warned]
    # The job comes from dcgm-exporter's pod labels, as the live collector reads them.
    assert pages[0]["job"] and where[leaky]["pod"] in pages[0]["job"] and (NAMESPACE in pages[0]["job"] or pages[0]["job"].endswith(where[leaky]["pod"]))
    assert len({p["id"] for p in pages}) == 1 and len(pages) == 1, "one leak, one page: not a new page every 57 s tick"


def test_nothing_pages_about_the_healthy_pods(replayed):
    leaky, where = replayed["leaky"], replayed["where"]
    others = [f for f in replayed["findings"] if f.get("severity") == "page" and _pod_of(f, where) not in (leaky,)]
    assert others == [], [(f.get("kind"), f.get("node"), f.get("gpu"), f.get("summary")) for f in others]
