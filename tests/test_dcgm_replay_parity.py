"""dcgm-exporter's series give the same frames live and replayed.

The same exposition is scraped by the live collector (a real HTTP server on 127.0.0.1) and
replayed, from a Prometheus text file with sample timestamps and from a Prometheus query_range
answer: `gpu_samples` and `gpu_workloads` (the job map from dcgm-exporter's pod/namespace/
container and hpc_job labels) must be equal. The scrapes are dcgm-exporter's label set and
fields: tests/data/dcgm/node07_constructed.prom (its default counters, see
tests/data/public/README.md) and small constructed ones for the label forms and the fields
outside the defaults (profiling fields, FB_RESERVED).
"""

from __future__ import annotations

import http.server
import json
import threading
from pathlib import Path

import polars as pl
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpuvigil import schemas
from gpuvigil.collectors import dcgm
from gpuvigil.offline.replay import Recorded, ReplayCollector, load_files, long_from_query_body, read_exposition_file, streams_from_long

DATA = Path(__file__).parent / "data"
TS = 1_796_000_000.0
GIB = 1 << 30
MIB = 1 << 20

_ID = 'gpu="{g}",UUID="GPU-{g}a7e0c3f-0000-0000-0000-00000000000{g}",pci_bus_id="00000000:{bus}:00.0",device="nvidia{g}",modelName="NVIDIA H100 80GB HBM3",Hostname="node-{n}"'


def _scrape(fields: dict[str, tuple[float, float]], extra: tuple[str, str] = ("", ""), node: str = "a") -> str:
    """Two GPUs' series of `fields` (name -> (GPU 0 value, GPU 1 value)); `extra` are labels
    added on GPU 0 and on GPU 1."""
    lines = []
    for name, values in fields.items():
        lines.append(f"# TYPE {name} gauge")
        for g, (v, more) in enumerate(zip(values, extra, strict=True)):
            labels = _ID.format(g=g, bus=f"{0x18 + g:02X}", n=node) + (f",{more}" if more else "")
            lines.append(f"{name}{{{labels}}} {v:g}")
    return "\n".join(lines) + "\n"


_MEMORY = {"DCGM_FI_DEV_FB_USED": (20480, 61440), "DCGM_FI_DEV_FB_FREE": (61013, 20053), "DCGM_FI_DEV_GPU_UTIL": (0, 98), "DCGM_FI_DEV_XID_ERRORS": (0, 13)}
CASES = {
    # dcgm-exporter's Kubernetes mapping: an empty pod label where no pod holds the GPU
    "pod_namespace_container": _scrape(_MEMORY, ('pod="",namespace="",container=""', 'pod="llama-7b-0",namespace="train",container="pytorch"')),
    # Prometheus without honorLabels: its target labels take the names, the workload's are exported_*
    "exported_pod": _scrape(_MEMORY, ('pod="dcgm-exporter-x",namespace="gpu-operator",exported_pod="eval-0",exported_namespace="eval"', 'pod="dcgm-exporter-x",namespace="gpu-operator",exported_pod="llama-7b-0",exported_namespace="train",exported_container="pytorch"')),
    # Slurm job mapping (DCGM_EXPORTER_HPC_JOB_MAPPING_DIR)
    "hpc_job": _scrape(_MEMORY, ('hpc_job="4711"', "")),
    "no_job_labels": _scrape(_MEMORY),
    "profiling_fields": _scrape(
        {
            **_MEMORY,
            "DCGM_FI_PROF_SM_ACTIVE": (0.02, 0.91),
            "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE": (0.0, 0.55),
            "DCGM_FI_PROF_DRAM_ACTIVE": (0.01, 0.37),
            "DCGM_FI_PROF_PCIE_TX_BYTES": (1.5e6, 2.25e9),
            "DCGM_FI_PROF_PCIE_RX_BYTES": (2.5e6, 1.75e9),
            "DCGM_FI_PROF_NVLINK_TX_BYTES": (0, 1.5e11),
            "DCGM_FI_PROF_NVLINK_RX_BYTES": (0, 1.25e11),
        },
        ('pod="a",namespace="b"', 'pod="c",namespace="b"'),
    ),
    "fb_reserved_and_total": _scrape({**_MEMORY, "DCGM_FI_DEV_FB_RESERVED": (455, 455), "DCGM_FI_DEV_FB_TOTAL": (81559, 81559)}, ('hpc_job="9"', 'hpc_job="9"')),
    "node07_default_counters": (DATA / "dcgm" / "node07_constructed.prom").read_text(),
}


class _Exporter:
    """A real HTTP server on 127.0.0.1 serving `body` as dcgm-exporter's /metrics."""

    def __init__(self, body: str) -> None:
        self.body = body.encode()
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                data = owner.body
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/metrics"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _live(text: str) -> dict[str, pl.DataFrame]:
    srv = _Exporter(text)
    collector = dcgm.DcgmCollector(srv.url)
    try:
        out = collector.collect(TS)
    finally:
        collector.close()
        srv.stop()
    assert collector.last_error is None
    return out


def _with_timestamps(text: str, ts: float) -> str:
    """The exposition as Prometheus text whose samples carry `ts` (milliseconds)."""
    return "\n".join(line if not line.strip() or line.startswith("#") else f"{line} {int(ts * 1000)}" for line in text.splitlines()) + "\n"


def _query_range_answer(text: str, ts: float) -> bytes:
    """What Prometheus' query_range answers for the exposition's series at `ts`: each series under
    the name it is exposed as (prometheus_client adds `_total` to a counter's samples; Prometheus
    stores what it scraped)."""
    exposed = {line.split("{", 1)[0].split(" ", 1)[0] for line in text.splitlines() if line and not line.startswith("#")}
    result = [
        {"metric": {"__name__": s.name if s.name in exposed else s.name.removesuffix("_total"), **s.labels}, "values": [[ts, repr(float(s.value))]]}
        for family in text_string_to_metric_families(text)
        for s in family.samples
    ]
    return json.dumps({"status": "success", "data": {"resultType": "matrix", "result": result}}).encode()


def _frames(streams: dict[str, pl.DataFrame], name: str) -> pl.DataFrame:
    df = streams.get(name, schemas.empty(name))
    assert df.schema == schemas.STREAMS[name]
    return df.sort(["node", "gpu"])


@pytest.mark.parametrize("case", list(CASES))
def test_live_and_replayed_series_give_the_same_frames(case, tmp_path):
    text = CASES[case]
    live = _live(text)
    path = tmp_path / "series.prom"
    path.write_text(_with_timestamps(text, TS))
    from_file = streams_from_long(read_exposition_file(path))
    from_query = streams_from_long(long_from_query_body(_query_range_answer(text, TS)))
    for replayed in (from_file, from_query):
        for name in ("gpu_samples", "gpu_workloads"):
            got, want = _frames(replayed, name), _frames(live, name)
            assert got.equals(want), (case, name, {c: (got[c].to_list(), want[c].to_list()) for c in want.columns if not got[c].equals(want[c])})
    # what each case is about is really in the frames (not two empty frames compared)
    samples = _frames(live, "gpu_samples").to_dicts()
    work = _frames(live, "gpu_workloads").to_dicts()
    assert [r["gpu"] for r in samples] == [0, 1] and all(r["memory_used_bytes"] is not None for r in samples)
    assert {r["xid_total"] for r in samples} >= {1}  # a GPU with a last XID counts it, live and replayed
    # the job map: a row per GPU that runs a labelled workload (a GPU that never did sends none)
    if case == "pod_namespace_container":
        assert [(r["gpu"], r["pod"], r["namespace"], r["container"], r["model_name"]) for r in work] == [(1, "llama-7b-0", "train", "pytorch", "NVIDIA H100 80GB HBM3")]
    elif case == "exported_pod":
        assert [(r["pod"], r["namespace"], r["container"]) for r in work] == [("eval-0", "eval", None), ("llama-7b-0", "train", "pytorch")]
    elif case == "hpc_job":
        assert [(r["gpu"], r["hpc_job"]) for r in work] == [(0, "4711")]
    elif case == "no_job_labels":
        assert work == [] and "gpu_workloads" not in live and "gpu_workloads" not in from_file
    elif case == "profiling_fields":
        assert (samples[1]["sm_active_ratio"], samples[1]["tensor_active_ratio"], samples[1]["dram_active_ratio"]) == (0.91, 0.55, 0.37)
        assert (samples[1]["pcie_tx_bytes_per_second"], samples[1]["nvlink_rx_bytes_per_second"]) == (2.25e9, 1.25e11)
    elif case == "fb_reserved_and_total":
        assert [r["memory_reserved_bytes"] for r in samples] == [455 * MIB] * 2
        assert [r["memory_total_bytes"] for r in samples] == [81559 * MIB] * 2  # FB_TOTAL, not used + free
    elif case == "node07_default_counters":
        assert [r["memory_total_bytes"] for r in samples][0] == (22 + 143137 + 615) * MIB
        assert [(r["gpu"], r["pod"]) for r in work] == [(1, "llama-pretrain-worker-3")]


def test_without_fb_total_capacity_needs_used_and_free():
    """FB_USED alone is no capacity: a GPU with only it has no total (not total = used)."""
    text = _scrape({"DCGM_FI_DEV_FB_USED": (100, 200)}) + _scrape({"DCGM_FI_DEV_FB_FREE": (900, 800)}, node="b")
    samples, _, _ = dcgm.parse_text(text, ts=TS)
    got = {(r["node"], r["gpu"]): (r["memory_used_bytes"], r["memory_total_bytes"]) for r in samples.to_dicts()}
    assert got == {("node-a", 0): (100 * MIB, None), ("node-a", 1): (200 * MIB, None), ("node-b", 0): (None, None), ("node-b", 1): (None, None)}


def _leak_series(path: Path, t0: float) -> None:
    """An 80 GiB GPU whose used memory grows smoothly from 20 to 80 GiB over 40 minutes, at
    dcgm-exporter's 30 s, as Prometheus text with timestamps (FB_USED + FB_FREE in MiB)."""
    labels = 'gpu="0",UUID="GPU-5d2f0c1e-0000-0000-0000-000000000000",Hostname="gpu-node-11",pod="llama-7b-0",namespace="train",container="pytorch"'
    lines = ["# TYPE DCGM_FI_DEV_FB_USED gauge", "# TYPE DCGM_FI_DEV_FB_FREE gauge"]
    for i in range(81):
        used = 20 * 1024 + (60 * 1024) * i // 80
        ms = int((t0 + 30 * i) * 1000)
        lines.append(f"DCGM_FI_DEV_FB_USED{{{labels}}} {used} {ms}")
        lines.append(f"DCGM_FI_DEV_FB_FREE{{{labels}}} {80 * 1024 - used} {ms}")
    path.write_text("\n".join(lines) + "\n")


def test_a_replayed_leak_belongs_to_the_pods_job(tmp_path):
    """Replayed from files, a GPU leaking towards OOM is mapped to the job of the pod on it, so
    the pipeline's per-GPU detectors see it (the map reaches `allocations`)."""
    from gpuvigil.pipeline.core import Pipeline

    t0 = 1_796_000_000.0
    path = tmp_path / "leak.prom"
    _leak_series(path, t0)
    recorded = Recorded()
    load_files([path], recorded)
    assert recorded.errors == [] and recorded.read == [str(path)]
    samples = recorded.stream("gpu_samples")
    assert samples.height == 81 and samples["memory_total_bytes"].unique().to_list() == [80 * GIB]
    assert (samples["memory_used_bytes"][0], samples["memory_used_bytes"][-1]) == (20 * GIB, 80 * GIB)
    work = recorded.stream("gpu_workloads")
    assert work.height == 81
    assert work.select("node", "gpu", "pod", "namespace", "container").unique().rows() == [("gpu-node-11", 0, "llama-7b-0", "train", "pytorch")]
    pipeline = Pipeline([ReplayCollector({k: recorded.stream(k) for k in recorded.frames})], [])
    for i in range(81):
        pipeline.tick(t0 + 30 * i)
        alloc = pipeline.window.get("allocations")
        assert alloc.select("job", "node", "gpu").rows() == [("train/llama-7b-0", "gpu-node-11", 0)], i


def test_a_workload_that_ends_leaves_the_map_live_and_replayed(tmp_path):
    """GPU 1 runs a pod for two scrapes, then none: one row without a workload says it ended
    (the pipeline drops the GPU from its map), and later scrapes send nothing. Live (the
    exporter's answer changes between scrapes) and replayed (one file of the four scrapes)."""
    from gpuvigil.pipeline.core import Pipeline

    labelled = _scrape(_MEMORY, ('pod="",namespace=""', 'pod="llama-7b-0",namespace="train"'))
    ended = _scrape(_MEMORY, ('pod="",namespace=""', 'pod="",namespace=""'))
    scrapes = [labelled, labelled, ended, ended]
    times = [TS + 30 * i for i in range(4)]
    srv = _Exporter(labelled)
    collector, in_pipeline = dcgm.DcgmCollector(srv.url), dcgm.DcgmCollector(srv.url)
    pipeline = Pipeline([in_pipeline], [])
    live_rows, jobs = [], []
    try:
        for text, t in zip(scrapes, times, strict=True):
            srv.body = text.encode()
            live_rows.append(collector.collect(t).get("gpu_workloads", schemas.empty("gpu_workloads")))
            pipeline.tick(t)
            jobs.append(pipeline.window.get("allocations").select("job", "gpu").rows())
    finally:
        collector.close()
        in_pipeline.close()
        srv.stop()
    live = pl.concat(live_rows)
    assert live.select("ts", "gpu", "pod").rows() == [(times[0], 1, "llama-7b-0"), (times[1], 1, "llama-7b-0"), (times[2], 1, None)]
    assert jobs == [[("train/llama-7b-0", 1)], [("train/llama-7b-0", 1)], [], []]
    path = tmp_path / "series.prom"
    path.write_text("".join(_with_timestamps(text, t) for text, t in zip(scrapes, times, strict=True)))
    replayed = streams_from_long(read_exposition_file(path))["gpu_workloads"]
    assert replayed.equals(live)


def test_a_workload_that_ends_between_ticks_leaves_the_map(tmp_path):
    """Recorded every 15 s (Prometheus' scrape interval), replayed at 30 s ticks: the pod ends
    at a sample in the middle of a tick, and the GPU leaves the job map at that tick."""
    from gpuvigil.pipeline.core import Pipeline

    labelled = _scrape(_MEMORY, ('pod="",namespace=""', 'pod="llama-7b-0",namespace="train"'))
    ended = _scrape(_MEMORY, ('pod="",namespace=""', 'pod="",namespace=""'))
    times = [TS + 15 * i for i in range(8)]
    scrapes = [labelled] * 2 + [ended] * 6  # the tick at TS + 30 brings TS + 15 (the pod) and TS + 30 (none)
    path = tmp_path / "series.prom"
    path.write_text("".join(_with_timestamps(text, t) for text, t in zip(scrapes, times, strict=True)))
    recorded = Recorded()
    load_files([path], recorded)
    pipeline = Pipeline([ReplayCollector({k: recorded.stream(k) for k in recorded.frames})], [])
    jobs = []
    for tick in (TS, TS + 30, TS + 60, TS + 90):
        pipeline.tick(tick)
        jobs.append(pipeline.window.get("allocations").select("job", "gpu").rows())
    assert jobs == [[("train/llama-7b-0", 1)], [], [], []]


def _hook_record(tmp_path: Path) -> Path:
    path = tmp_path / "hook.jsonl"
    rec = {"ts": TS, "job": "llama", "rank": 0, "node": "node-a", "gpu": 0, "step": 7, "step_time_seconds": 1.5}
    path.write_text(json.dumps(rec) + "\n")
    return path


@pytest.mark.parametrize(
    ("name", "kind", "stream"),
    [
        ("nvml_csv", "nvml_csv", "gpu_samples"),  # the real H200's NVML series
        ("hook_jsonl", "hook_jsonl", "rank_progress"),
        ("prometheus_ms", "exposition", "gpu_samples"),  # Prometheus text, millisecond stamps
        ("openmetrics", "exposition", "gpu_samples"),  # OpenMetrics, second stamps, # EOF
        ("single_scrape", None, None),  # no timestamps: a scrape, for analyze
        ("kernel_log", None, None),
    ],
)
def test_replay_and_the_report_recognise_and_read_saved_series_alike(name, kind, stream, tmp_path):
    from gpuvigil.offline.replay import read_series_file, series_kind
    from gpuvigil.offline.report import _series_from_inputs

    text = CASES["hpc_job"]
    paths = {
        "nvml_csv": DATA / "h200" / "nvml_timeseries.csv",
        "hook_jsonl": _hook_record(tmp_path),
        "prometheus_ms": tmp_path / "series.prom",
        "openmetrics": tmp_path / "series.om",
        "single_scrape": DATA / "dcgm" / "node07_constructed.prom",
        "kernel_log": DATA / "public" / "kernel_xids.log",
    }
    paths["prometheus_ms"].write_text(_with_timestamps(text, TS))
    paths["openmetrics"].write_text("\n".join(ln if ln.startswith("#") or not ln else f"{ln} {TS:.0f}" for ln in text.splitlines()) + "\n# EOF\n")
    path = paths[name]
    head = path.read_bytes()[:65536].decode("utf-8", errors="replace")
    assert series_kind(head) == kind
    streams = read_series_file(path, head, node="n")
    assert (streams is None) == (kind is None)
    gs, rp = _series_from_inputs([path])
    if stream is None:
        assert gs is None and rp is None
        return
    assert streams[stream].height > 0
    plotted = gs if stream == "gpu_samples" else rp
    assert plotted is not None and plotted.height == streams[stream].height


def test_labels_are_read_alike_live_from_files_and_from_query_answers(tmp_path):
    """Property: for any set of dcgm-exporter's labels (empty values, the `exported_` forms,
    escapes), the file reader, the query_range reader and the live collector's `label_values`
    give the same columns (the file reader reads label text with patterns built from the same
    table, collectors/dcgm.py: LABELS)."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    names = sorted({n for names in dcgm.LABELS.values() for n in names})
    value = st.text(alphabet=list('ab-0 "\\\n,={}') + ["é"], max_size=5)
    labels = st.dictionaries(st.sampled_from(names), value, max_size=8).map(lambda d: {**d, "gpu": d.get("gpu") or "0"})

    def esc(v: str) -> str:
        return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(st.lists(labels, min_size=1, max_size=4))
    def check(series):
        cols = [c for c in dcgm.LABELS if c != "gpu"]
        lines = [f"DCGM_FI_DEV_GPU_TEMP{{{','.join(f'{k}={chr(34)}{esc(v)}{chr(34)}' for k, v in ls.items())}}} {60 + i} {int(TS * 1000)}" for i, ls in enumerate(series)]
        path = tmp_path / "l.prom"
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        expected = sorted((60.0 + i, *(dcgm.label_values(ls)[c] or "" for c in cols)) for i, ls in enumerate(series))
        from_file = read_exposition_file(path)
        answer = json.dumps({"status": "success", "data": {"resultType": "matrix", "result": [
            {"metric": {"__name__": "DCGM_FI_DEV_GPU_TEMP", **ls}, "values": [[TS, str(60 + i)]]} for i, ls in enumerate(series)
        ]}}).encode()
        from_query = long_from_query_body(answer)
        for got in (from_file, from_query):
            assert sorted((r[0], *(v or "" for v in r[1:])) for r in got.select("value", *cols).rows()) == expected

    check()
