"""`gpuvigil replay`: recorded history through the streaming pipeline, in recorded time.

The Prometheus test runs a real Prometheus 2.42 (Debian `prometheus`) whose TSDB is filled with
`promtool tsdb create-blocks-from openmetrics` from dcgm-exporter series the test generates
(benchmarks/replay_series.py: generated values, faults at known times). The file tests replay
the same series from an OpenMetrics file, and real logs (tests/data) fired at their own time.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from benchmarks.replay_series import Fault, Fleet, write_openmetrics
import gpuvigil.cli.main as cli
from gpuvigil.errors import UserError
from gpuvigil.offline.replay import Recorded, load_files, parse_duration, parse_time, prometheus_chunks, run_replay

DATA = Path(__file__).parent / "data"
STEP = 30.0


def _fleet(t0: float) -> Fleet:
    return Fleet(
        nodes=2,
        start=t0,
        seconds=3600,
        step=STEP,
        faults=[
            Fault("gpu-node-001", 3, "xid79", t0 + 1800),
            Fault("gpu-node-000", 5, "thermal", t0 + 600, t0 + 1500),
            Fault("gpu-node-001", 6, "dbe", t0 + 2400),
        ],
    )


def _records(capsys) -> list[dict]:
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]


def _check_fleet_replay(records: list[dict], t0: float) -> None:
    findings = [r for r in records if r["record"] == "finding"]
    by = {(r["kind"], r["node"], r["gpu"]): r for r in findings}
    # each fault fires once, on the first tick that sees it, on the GPU it hit
    xid = by[("xid", "gpu-node-001", 3)]
    assert xid["xid"] == 79 and xid["severity"] == "page" and xid["action"] == "RESTART_BM"
    assert t0 + 1800 <= xid["fired_at"] <= t0 + 1800 + STEP
    thermal = by[("thermal_throttle", "gpu-node-000", 5)]
    assert t0 + 600 <= thermal["fired_at"] <= t0 + 600 + 3 * STEP
    ecc = by[("ecc", "gpu-node-001", 6)]
    assert t0 + 2400 <= ecc["fired_at"] <= t0 + 2400 + STEP and ecc["severity"] == "page"
    # same fields as analyze, plus when it fired
    assert set(xid) >= {"kind", "severity", "ts", "job", "ranks", "culprit_ranks", "node", "gpu", "xid", "action", "cause", "evidence", "summary", "source", "id", "fired_at"}
    assert len(findings) == 3, [(r["kind"], r["node"], r["gpu"]) for r in findings]
    hints = [r for r in records if r["record"] == "hint"]
    assert {(h["action"], h["node"]) for h in hints} >= {("cordon_node", "gpu-node-001"), ("drain_node", "gpu-node-001")}
    (summary,) = [r for r in records if r["record"] == "summary"]
    assert summary["gpus"] == 16 and summary["pages"] == 2
    assert summary["pages_by_kind"] == {"ecc": 1, "xid": 1}
    gpu_days = 16 * 3600 / 86400
    assert summary["pages_per_gpu_day"] == pytest.approx(2 / gpu_days, rel=1e-3)


def test_replay_openmetrics_file(tmp_path, capsys):
    t0 = 1_764_000_000.0
    om = tmp_path / "dcgm.om"
    write_openmetrics(_fleet(t0), om)
    assert cli.main(["replay", str(om), "--step", "30s", "--format", "json"]) == 0
    _check_fleet_replay(_records(capsys), t0)


def test_replay_text_output_says_when_and_how_often(tmp_path, capsys):
    t0 = 1_764_000_000.0
    om = tmp_path / "dcgm.om"
    write_openmetrics(_fleet(t0), om)
    assert cli.main(["replay", str(om)]) == 0
    out = capsys.readouterr().out
    assert "fired at 2025-11-24T16:30:00Z" in out and "XID 79" in out
    assert "hint cordon_node at 2025-11-24T16:30:00Z (node gpu-node-001, gpu 3)" in out
    assert "2 page(s) = 3 per GPU-day" in out and "pages by kind: ecc 1 (1.5/GPU-day), xid 1 (1.5/GPU-day)" in out


@pytest.mark.services
def test_replay_from_real_prometheus(tmp_path, capsys):
    from services import binary, prometheus_server

    promtool = binary("promtool")
    # the recent past: inside the default retention, older than the head block
    t0 = float(int(time.time() // 3600) * 3600 - 5 * 3600)
    om = tmp_path / "dcgm.om"
    write_openmetrics(_fleet(t0), om)
    workdir = tmp_path / "prom"
    (workdir / "data").mkdir(parents=True)
    subprocess.run([promtool, "tsdb", "create-blocks-from", "openmetrics", str(om), str(workdir / "data")], check=True, capture_output=True, timeout=300)
    with prometheus_server({"global": {"scrape_interval": "15s"}, "scrape_configs": []}, workdir) as prom:
        start = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0))  # RFC 3339 ...
        end = f"{t0 + 3600:.0f}"  # ... and unix seconds, as promtool takes them
        assert cli.main(["replay", "--prometheus", prom.url, "--start", start, "--end", end, "--step", "30s", "--format", "json"]) == 0
        _check_fleet_replay(_records(capsys), t0)
        # fetched in 10-minute chunks (bounded memory): same findings, the last XID not re-counted
        chunked = run_replay(Recorded(), step=STEP, start=t0, end=t0 + 3600, chunks=prometheus_chunks(prom.url, t0, t0 + 3600, STEP, chunk_seconds=600))
    assert sorted((f.finding.kind.value, f.finding.node, f.finding.gpu) for f in chunked.findings) == [
        ("ecc", "gpu-node-001", 6), ("thermal_throttle", "gpu-node-000", 5), ("xid", "gpu-node-001", 3)
    ]
    assert chunked.gpus == 16 and chunked.ticks == 121


def test_replay_logs_fire_at_their_own_time_through_the_hint_rules(tmp_path):
    recorded = Recorded()
    load_files([DATA / "public" / "kernel_dbe_syslog.log", DATA / "h200" / "s3_fragmentation.log"], recorded, node="worker4", job="train")
    assert not recorded.errors
    result = run_replay(recorded, step=60.0)
    kinds = {f.finding.kind.value for f in result.findings}
    assert {"xid", "oom_fragmentation"} <= kinds
    for f in result.findings:
        assert result.start <= f.at <= result.end
    # the fragmentation OOM gets the hint rule's remedy (restart with expandable segments)
    assert any(h.hint.action.value == "set_alloc_conf" and h.hint.job == "train" for h in result.hints)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("1764000000", 1_764_000_000.0), ("1764000000.5", 1_764_000_000.5), ("2025-11-24T16:00:00Z", 1_764_000_000.0), ("2025-11-24T17:00:00+01:00", 1_764_000_000.0)],
)
def test_time_arguments(text, expected):
    assert parse_time(text) == expected


def test_bad_arguments_are_one_line_errors():
    with pytest.raises(UserError):
        parse_time("yesterday")
    with pytest.raises(UserError):
        parse_duration("fast")
    assert parse_duration("1m") == 60 and parse_duration("30s") == 30 and parse_duration("15") == 15


# -- speed work must not change what replay says ---------------------------------------------------
def _golden_fleet(t0: float) -> Fleet:
    return Fleet(
        nodes=3,
        start=t0,
        seconds=5400,
        step=STEP,
        faults=[
            Fault("gpu-node-001", 3, "xid79", t0 + 1800),
            Fault("gpu-node-000", 5, "thermal", t0 + 600, t0 + 1500),
            Fault("gpu-node-002", 6, "dbe", t0 + 2400),
            Fault("gpu-node-002", 1, "thermal", t0 + 3000, t0 + 4200),
            Fault("gpu-node-000", 0, "xid79", t0 + 4000, t0 + 4500),
        ],
    )


def test_replay_output_is_unchanged_by_the_fast_reader(tmp_path, capsys):
    """tests/data/golden/replay_fleet.json was written by the replay before the fast text reader
    (regex per line, labels per line): findings, hints, fire times and summary must not move."""
    import golden

    t0 = 1_764_000_000.0
    om = tmp_path / "dcgm.om"
    write_openmetrics(_golden_fleet(t0), om)
    assert cli.main(["replay", str(om), "--step", "30s", "--format", "json"]) == 0
    records = _records(capsys)
    for r in records:
        r.pop("wall_seconds", None)
    kinds = sorted((r["kind"], r["node"], r["gpu"], r["fired_at"] - t0) for r in records if r["record"] == "finding")
    assert kinds == [
        ("ecc", "gpu-node-002", 6, 2400), ("thermal_throttle", "gpu-node-000", 5, 600), ("thermal_throttle", "gpu-node-002", 1, 3000),
        ("xid", "gpu-node-000", 0, 4020), ("xid", "gpu-node-001", 3, 1800),
    ]
    golden.check_json(DATA / "golden" / "replay_fleet.json", records)


def _sorted(df):
    return df.sort(df.columns, nulls_last=True)


def _read_both(path: Path):
    from gpuvigil.offline.replay import read_exposition_file

    out = []
    for fast in (True, False):
        try:
            out.append(_sorted(read_exposition_file(path, fast=fast)))
        except UserError as exc:
            out.append(("error", str(exc)))
    return out


def test_fast_reader_equals_the_regex_reader_in_small_chunks(tmp_path):
    from gpuvigil.offline.replay import read_exposition_file

    om = tmp_path / "dcgm.om"
    write_openmetrics(_fleet(1_764_000_000.0), om)
    fast, slow = _read_both(om)
    assert fast.height == 16 * 121 * 9 and fast.equals(slow)
    # chunk boundaries fall inside lines: the reader carries the partial line over
    assert _sorted(read_exposition_file(om, chunk_bytes=4096)).equals(fast)


_NAMES = ["DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_XID_ERRORS", "gpuvigil_rank_step", "other_metric"]
_LABELS = ["Hostname", "gpu", "UUID", "rank", "job", "exported_job", "modelName", "instance"]


def _line_strategy():
    from hypothesis import strategies as st

    value = st.one_of(st.integers(-10**6, 10**9).map(str), st.floats(allow_nan=True, allow_infinity=True).map(repr), st.sampled_from(["NaN", "+Inf", "-Inf", "1e3", "x"]))
    ts = st.one_of(st.integers(1_700_000_000, 1_800_000_000).map(str), st.integers(1_700_000_000_000, 1_800_000_000_000).map(str), st.just("1764000000.250"))
    label_value = st.text(alphabet=st.sampled_from(list('ab01 -_.,="{}\\\t') + ["\u00a0", "é"]), max_size=8)
    labels = st.lists(st.tuples(st.sampled_from(_LABELS), label_value), max_size=4).map(lambda kv: ",".join(f'{k}="{v}"' for k, v in kv))
    sample = st.builds(lambda n, lb, v, t, sep: f"{n}{{{lb}}}{sep}{v}{sep}{t}" if lb else f"{n}{sep}{v}{sep}{t}", st.sampled_from(_NAMES), labels, value, ts, st.sampled_from([" ", " ", "  ", "\t"]))
    garbage = st.text(max_size=60).map(lambda s: s.replace("\n", " ").replace("\r", " "))
    return st.lists(st.one_of(sample, sample, garbage, st.just("# EOF"), st.just("# TYPE DCGM_FI_DEV_GPU_TEMP gauge")), max_size=25)


def test_fast_reader_agrees_with_the_regex_reader_and_survives_garbage(tmp_path):
    """Property: on any text (valid samples, odd spacing, braces and quotes in label values,
    Unicode spaces, garbage lines) the fast split reads exactly what one regex per line reads,
    or both refuse the file with a one-line error."""
    from hypothesis import HealthCheck, given, settings

    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(_line_strategy())
    def check(lines):
        path = tmp_path / "x.prom"
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        fast, slow = _read_both(path)
        if isinstance(fast, tuple) or isinstance(slow, tuple):
            assert fast == slow
        else:
            assert fast.equals(slow)

    check()


def _none_first(row: tuple) -> tuple:
    """Sort key for rows that may hold None (a series without a UUID beside one with it)."""
    return tuple((v is not None, "" if v is None else v) for v in row)


def test_fast_reader_agrees_with_prometheus_client_on_valid_openmetrics(tmp_path):
    """Property against the reference parser (prometheus_client's OpenMetrics parser): every
    timestamped sample of a mapped series is read with its value, time and labels."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from prometheus_client.openmetrics.parser import text_string_to_metric_families

    from gpuvigil.offline.replay import read_exposition_file

    gauges = ["DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_POWER_USAGE", "other_gauge"]
    plain = st.text(alphabet="abcXYZ019-_. ", min_size=1, max_size=10)
    series = st.tuples(st.sampled_from(gauges), plain, st.integers(0, 7).map(str), st.one_of(st.none(), plain))
    point = st.tuples(st.integers(-(10**6), 10**9), st.integers(1_700_000_000, 1_800_000_000), st.sampled_from(["", ".5", ".125"]))

    @settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(st.dictionaries(series, st.lists(point, min_size=1, max_size=4, unique_by=lambda p: (p[1], p[2])), min_size=1, max_size=5))
    def check(data):
        lines, by_name = [], {}
        for (name, host, gpu, uuid), points in data.items():
            by_name.setdefault(name, []).append((host, gpu, uuid, points))
        for name, items in by_name.items():
            lines.append(f"# TYPE {name} gauge")
            for host, gpu, uuid, points in items:
                labels = f'Hostname="{host}",gpu="{gpu}"' + (f',UUID="{uuid}"' if uuid is not None else "")
                lines += [f"{name}{{{labels}}} {v} {t}{frac}" for v, t, frac in sorted(points, key=lambda p: (p[1], p[2]))]
        text = "\n".join(lines) + "\n# EOF\n"
        expected = sorted(
            ((s.name, s.labels["Hostname"], s.labels["gpu"], s.labels.get("UUID"), float(s.value), float(s.timestamp))
             for fam in text_string_to_metric_families(text) for s in fam.samples if s.name.startswith("DCGM_FI_")),
            key=_none_first,
        )
        path = tmp_path / "x.om"
        path.write_text(text)
        if not expected:
            with pytest.raises(UserError):
                read_exposition_file(path)
            return
        got = sorted(read_exposition_file(path).select("metric", "node", "gpu", "gpu_uuid", "value", "ts").rows(), key=_none_first)
        assert got == expected

    check()


def _per_series_reference(result):
    """query_range matrix -> LONG the way replay read it before (one frame per series)."""
    import polars as pl

    from gpuvigil.offline.replay import LONG, _labels_row

    frames = []
    for series in result:
        values = series.get("values") or []
        if not values:
            continue
        base = _labels_row(series["metric"].get("__name__", ""), series["metric"], 0.0, 0.0)
        frame = pl.DataFrame(values, schema={"ts": pl.Float64, "v": pl.Utf8}, orient="row")
        frames.append(frame.select(
            "ts", pl.lit(base["metric"], pl.Utf8).alias("metric"), pl.col("v").cast(pl.Float64, strict=False).alias("value"),
            *[pl.lit(base[c], pl.Utf8).alias(c) for c in LONG if c not in ("ts", "metric", "value")],
        ))
    if not frames:
        return pl.DataFrame(schema=LONG)
    out = pl.concat(frames, how="vertical_relaxed").filter(pl.col("value").is_not_null() & ~pl.col("value").is_nan())
    return out.select([pl.col(c).cast(t) for c, t in LONG.items()])


def test_query_range_answer_is_read_as_one_frame_with_the_same_rows():
    """Property: the one-frame reading of a query_range matrix equals the per-series reading
    (NaN/Inf values, empty series, missing labels, rank series with exported_job)."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from gpuvigil.offline.replay import long_from_query_result

    label = st.one_of(st.none(), st.text(alphabet="abc-01", min_size=1, max_size=4))
    metric = st.builds(
        lambda name, host, gpu, uuid, job, rank: {k: v for k, v in {"__name__": name, "Hostname": host, "gpu": gpu, "UUID": uuid, "exported_job": job, "rank": rank}.items() if v is not None},
        st.sampled_from(["DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_XID_ERRORS", "gpuvigil_rank_step", "gpuvigil_gpu_pcie_replays", "x"]), label, label, label, label, label,
    )
    value = st.one_of(st.integers(-5, 10**6).map(str), st.sampled_from(["NaN", "+Inf", "-Inf", "1.5e3", "bad"]))
    point = st.tuples(st.one_of(st.integers(1_700_000_000, 1_800_000_000), st.floats(1.7e9, 1.8e9)), value).map(list)
    series = st.builds(lambda m, v: {"metric": m, "values": v}, metric, st.lists(point, max_size=6))

    @settings(max_examples=80, deadline=None)
    @given(st.lists(series, max_size=6))
    def check(result):
        assert long_from_query_result(result).equals(_per_series_reference(result))

    check()


def test_query_range_json_read_by_polars_equals_the_json_reading():
    """Property: polars' reading of the answer's bytes gives the rows json.loads + the
    per-series reading gives; answers it cannot vouch for (errors, empty) are left to json."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from gpuvigil.offline.replay import long_from_query_body

    # escapes, braces and non-ASCII in values; labels replay does not read (modelName, pod) and
    # the fallbacks it does (hostname, instance, job): the reader names only the labels it uses
    label = st.one_of(st.none(), st.text(alphabet=list('abc-01 "\\{}é'), max_size=4))
    metric = st.builds(
        lambda name, host, gpu, uuid, job, rank, extra: {
            k: v
            for k, v in {"__name__": name, "Hostname": host, "gpu": gpu, "UUID": uuid, "exported_job": job, "rank": rank, **extra}.items()
            if v is not None
        },
        st.sampled_from(["DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_XID_ERRORS", "gpuvigil_rank_step", "x"]), label, label, label, label, label,
        st.dictionaries(st.sampled_from(["modelName", "pod", "hostname", "instance", "job", "node", "gpu_uuid"]), st.text(alphabet="xy é", max_size=3), max_size=3),
    )
    value = st.one_of(st.integers(-5, 10**6).map(str), st.sampled_from(["NaN", "+Inf", "-Inf", "1.5e3", "0.125"]))
    ts = st.one_of(st.integers(1_700_000_000, 1_800_000_000), st.integers(1_700_000_000_000, 1_800_000_000_000).map(lambda ms: ms / 1000))
    series = st.builds(lambda m, v: {"metric": m, "values": v}, metric, st.lists(st.tuples(ts, value).map(list), max_size=5))

    @settings(max_examples=80, deadline=None)
    @given(st.lists(series, max_size=5))
    def check(result):
        body = json.dumps({"status": "success", "data": {"resultType": "matrix", "result": result}}).encode()
        got = long_from_query_body(body)
        if any(s["values"] for s in result):
            assert got is not None
        if got is not None:
            assert got.equals(_per_series_reference(result))

    check()
    assert long_from_query_body(b'{"status": "error", "errorType": "bad_data", "error": "x"}') is None
    assert long_from_query_body(b"not json") is None


def test_prefetch_keeps_order_and_raises_the_producers_error():
    from gpuvigil.offline.replay import prefetch

    assert list(prefetch(iter(range(50)), depth=2)) == list(range(50))

    def failing():
        yield 1
        raise UserError("query_range failed")

    it = prefetch(failing())
    assert next(it) == 1
    with pytest.raises(UserError, match="query_range failed"):
        next(it)
    # a consumer that stops early releases the producer
    gen = prefetch(iter(range(1000)))
    assert next(gen) == 0
    gen.close()


def test_reader_agrees_with_prometheus_client_on_escaped_label_values(tmp_path):
    """Property against prometheus_client's Prometheus text parser: label values with escaped
    quotes, backslashes and newlines, and braces, commas, `=`, `#` and spaces (dcgm-exporter's
    modelName has one) are read to the same sample, value, time (ms stamps) and labels."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from prometheus_client.parser import text_string_to_metric_families

    from gpuvigil.offline.replay import read_exposition_file

    gauges = ["DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_FB_USED", "other_gauge"]
    value_text = st.text(alphabet=list('ab Z0-_.,={}#"\\\n') + ["é"], min_size=1, max_size=10)

    def esc(v: str) -> str:
        return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

    series = st.tuples(st.sampled_from(gauges), value_text, st.integers(0, 7).map(str), st.one_of(st.none(), value_text), value_text)
    point = st.tuples(st.one_of(st.integers(-(10**6), 10**9).map(str), st.sampled_from(["0.5", "1e3", "-2.25"])), st.integers(1_700_000_000_000, 1_800_000_000_000))

    @settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(st.dictionaries(series, st.lists(point, min_size=1, max_size=3, unique_by=lambda p: p[1]), min_size=1, max_size=5))
    def check(data):
        lines = []
        for (name, host, gpu, uuid, model), points in data.items():
            labels = f'gpu="{gpu}",modelName="{esc(model)}",Hostname="{esc(host)}"' + (f',UUID="{esc(uuid)}"' if uuid is not None else "")
            lines += [f"{name}{{{labels}}} {v} {t}" for v, t in points]
        text = "\n".join(lines) + "\n"
        expected = sorted(
            ((s.name, s.labels["Hostname"], s.labels["gpu"], s.labels.get("UUID"), float(s.value), float(s.timestamp))
             for fam in text_string_to_metric_families(text) for s in fam.samples if s.name.startswith("DCGM_FI_")),
            key=_none_first,
        )
        path = tmp_path / "x.prom"
        path.write_text(text, encoding="utf-8")
        if not expected:
            with pytest.raises(UserError):
                read_exposition_file(path)
            return
        got = sorted(read_exposition_file(path).select("metric", "node", "gpu", "gpu_uuid", "value", "ts").rows(), key=_none_first)
        assert got == expected

    check()


def test_reader_never_crashes_on_garbage_bytes(tmp_path):
    """Fuzz: any bytes (binary, broken UTF-8, NULs, the reader's own column separator, huge
    lines) give rows or a one-line UserError, never another exception."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from gpuvigil.offline.replay import read_exposition_file

    sample = b'DCGM_FI_DEV_GPU_TEMP{gpu="0",Hostname="n"} 61 1764000000000\n'
    chunk = st.one_of(st.binary(max_size=80), st.just(sample), st.sampled_from([b"\x1f", b"\x00", b"\r\n", b"\xff\xfe", b"# EOF\n", b"{", b"}", b" ", b"\t", b" # {", b' # {a="1"} 2 3', b"\\"]))

    @settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(st.lists(chunk, max_size=20), st.sampled_from([64, 4096]))
    def check(parts, chunk_bytes):
        path = tmp_path / "g.prom"
        path.write_bytes(b"".join(parts))
        for fast in (True, False):
            try:
                df = read_exposition_file(path, fast=fast, chunk_bytes=chunk_bytes)
            except UserError as exc:
                assert "\n" not in str(exc)
            else:
                assert df.height > 0 and df.columns == [
                    "ts", "metric", "value", "node", "gpu", "gpu_uuid", "job", "rank", "model_name", "pci_bus_id", "pod", "namespace", "container", "hpc_job",
                    "device", "port", "link_layer",
                ]

    check()


def test_exemplar_lines_are_read_as_prometheus_client_reads_them(tmp_path):
    """Property: OpenMetrics counter samples with exemplars (` # {trace_id="..."} V [T]`) give
    the sample's own value and time, as prometheus_client's OpenMetrics parser reads them (the
    one-regex reading used to take the exemplar's value); plain lines around them are unchanged."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from prometheus_client.openmetrics.parser import text_string_to_metric_families

    from gpuvigil.offline.replay import read_exposition_file

    trace = st.text(alphabet="abc019 #{}", min_size=1, max_size=8).map(lambda v: v.replace("\\", ""))
    exemplar = st.one_of(st.just(""), st.builds(lambda t, v, ts: f' # {{trace_id="{t}"}} {v}' + (f" {ts}" if ts else ""), trace, st.sampled_from(["1", "0.5", "1e3"]), st.sampled_from(["", "1764000000.5"])))
    point = st.tuples(st.integers(0, 10**9), st.integers(1_700_000_000, 1_800_000_000), st.sampled_from(["", ".25", ".125"]), exemplar)

    @settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(st.dictionaries(st.tuples(st.sampled_from(["n0", "n1"]), st.integers(0, 3)), st.lists(point, min_size=1, max_size=4, unique_by=lambda p: (p[1], p[2])), min_size=1, max_size=3))
    def check(data):
        lines = ["# TYPE gpuvigil_gpu_pcie_replays counter"]
        for (node, gpu), points in data.items():
            lines += [f'gpuvigil_gpu_pcie_replays_total{{node="{node}",gpu="{gpu}"}} {v} {t}{frac}{ex}' for v, t, frac, ex in sorted(points, key=lambda p: (p[1], p[2]))]
        text = "\n".join(lines) + "\n# EOF\n"
        expected = sorted(
            (s.labels["node"], s.labels["gpu"], float(s.value), float(f"{s.timestamp.sec}.{s.timestamp.nsec:09d}"))
            for fam in text_string_to_metric_families(text) for s in fam.samples if s.name.endswith("_total")
        )
        path = tmp_path / "x.om"
        path.write_text(text)
        for fast in (True, False):
            got = sorted(read_exposition_file(path, fast=fast).select("node", "gpu", "value", "ts").rows())
            assert got == expected

    check()


def test_replay_json_findings_carry_exactly_analyzes_fields(capsys):
    """`replay --format json` finding records are `analyze --format json`'s objects, same keys and
    values, plus `record`, `fired_at` and the incident each belongs to (the same fields as analyze)."""
    files = [str(DATA / "public" / "kernel_dbe_syslog.log"), str(DATA / "h200" / "s3_fragmentation.log")]
    assert cli.main(["analyze", "--format", "json", "--node", "worker4", "--job", "train", *files]) in (0, 1)
    analyzed = [r for r in _records(capsys) if "kind" in r]
    assert cli.main(["replay", "--format", "json", "--node", "worker4", "--job", "train", "--step", "60", *files]) == 0
    replayed = [r for r in _records(capsys) if r["record"] == "finding"]
    assert analyzed and len(replayed) == len(analyzed)
    # Replay places every finding in an incident (pipeline/incidents.py), logs and dumps included.
    assert all(r["incident"] and r["incident_role"] in ("opened", "update", "evidence") for r in replayed)
    stripped = sorted(json.dumps({k: v for k, v in r.items() if k not in ("record", "fired_at", "incident", "incident_role")}, sort_keys=True) for r in replayed)
    assert stripped == sorted(json.dumps(r, sort_keys=True) for r in analyzed)
