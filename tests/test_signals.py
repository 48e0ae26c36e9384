"""The table of telemetry columns (gpuvigil/signals.py) against what reads and fills them.

- what is derived from it is what the code uses: the `gpu_samples` schema, dcgm-exporter's
  mapping (live and replay), gpuvigil's exporter series, the NVML collector's columns;
- the reality contract: every column of every stream a detector reads names the real
  collectors that fill it. A column only the simulator fills fails, unless it is in
  `SIMULATOR_ONLY_ALLOWED` with the reason: that list is meant to shrink, and an entry that is
  no longer needed fails too.
"""

from __future__ import annotations

import ast
import inspect
import sys
from pathlib import Path

import polars as pl
import pytest

from gpuvigil import schemas, signals
from gpuvigil.collectors import dcgm
from gpuvigil.pipeline.levels import DERIVED
from gpuvigil.detectors.registry import default_detectors

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_samples_schema_is_the_table():
    assert list(schemas.GPU_SAMPLES.items()) == [(s.name, s.dtype) for s in signals.GPU_COLUMNS]
    assert len({s.name for s in signals.GPU_COLUMNS}) == len(signals.GPU_COLUMNS)
    for s in signals.GPU_COLUMNS:
        assert s.unit is not None and s.description, s.name
        assert s.producers <= set(signals.DEFAULT_SOURCES) - {"jobmap", "scheduler"}, s.name


def test_dcgm_defaults_agree_with_the_producers():
    """A column dcgm-exporter fills by default is one with a default-counters field, and the
    other way round (xid_total: counted from DCGM_FI_DEV_XID_ERRORS by whoever watches it)."""
    for s in signals.GPU_SIGNALS:
        if s.dcgm is None:
            continue
        assert set(s.dcgm.default) <= set(s.dcgm.fields), s.name
        assert s.dcgm.how in signals.DCGM_COMBINE, s.name
        assert bool(s.dcgm.default) == ("dcgm" in s.producers), s.name
        assert all(f.startswith("DCGM_FI_") for f in s.dcgm.fields), s.name
    assert "dcgm" in signals.BY_NAME["xid_total"].producers and "DCGM_FI_DEV_XID_ERRORS" in signals.BY_NAME["last_xid"].dcgm.fields


def test_default_counters_scrape_fills_exactly_the_dcgm_default_columns():
    """tests/data/dcgm/node07_constructed.prom is dcgm-exporter's default counters plus
    FB_RESERVED, the ECC volatile totals and CLOCKS_EVENT_REASONS (tests/data/public/README.md):
    the columns it fills are the table's dcgm defaults and those three's columns."""
    samples, _, _ = dcgm.read_scrape(ROOT / "tests" / "data" / "dcgm" / "node07_constructed.prom", ts=1.0)
    filled = {c for c in samples.columns if samples[c].null_count() < samples.height}
    default = {s.name for s in signals.GPU_COLUMNS if "dcgm" in s.producers} - {"xid_total"}  # counted by the collector, not in a scrape
    added = {"memory_reserved_bytes", "ecc_sbe_volatile_total", "ecc_dbe_volatile_total", "throttle_reasons"}
    assert filled == default | added


def test_dcgm_fields_are_read_live_and_in_replay():
    from gpuvigil.offline import replay

    fields = set(signals.DCGM_FIELDS)
    assert fields <= set(dcgm.FIELDS_USED) and fields == set(replay.DCGM_FIELDS)
    assert {"DCGM_FI_DEV_FB_RESERVED", "DCGM_FI_PROF_SM_ACTIVE", "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "DCGM_FI_PROF_DRAM_ACTIVE"} <= set(replay.ALL_FIELDS)


def test_exporter_series_are_the_tables():
    """gpuvigil's own GPU series (exporter/metrics.py) carry the names and scales of the table,
    which replay reads them back by."""
    from gpuvigil.exporter.metrics import GPU_SPECS
    from gpuvigil.offline.replay import GPUVIGIL_GPU_FIELDS

    exported = {column: (name + ("_total" if kind == "counter" else ""), float(scale)) for name, kind, column, _help, scale in GPU_SPECS}
    table = {s.name: (s.prometheus, s.prometheus_scale) for s in signals.GPU_SIGNALS if s.prometheus}
    assert exported == table
    assert {col for col, _ in GPUVIGIL_GPU_FIELDS.values()} == set(table) - {"xid_total"}  # replay counts XIDs from last_xid


def test_nvml_columns_are_the_tables():
    """The NVML collector fills the columns the table says NVML has (driven by the in-memory
    NVML of tests/test_nvml.py: a healthy H200)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from test_nvml import FakeNvml, h200

    from gpuvigil.collectors import nvml

    nvml_columns = {s.name for s in signals.GPU_COLUMNS if "nvml" in s.producers}
    assert set(signals.nvml_calls()) >= nvml_columns - {"ts", "node"}
    fake = FakeNvml([h200("GPU-a")])
    with nvml.NvmlCollector(node="n1", nvml=fake, events=False) as collector:
        collector.collect(100.0)
        samples = collector.collect(101.0)["gpu_samples"]
    filled = {c for c in samples.columns if samples[c].null_count() < samples.height}
    assert filled <= nvml_columns
    # the ones the in-memory NVML does not emulate (PCIe byte counters, XID events) are still
    # written by the collector's code
    source = (ROOT / "gpuvigil" / "collectors" / "nvml.py").read_text()
    literals = {n.value for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    assert nvml_columns <= literals | filled


# -- the reality contract ------------------------------------------------------------------------

# (detector, stream, column) that only the simulator fills today, with the reason. Shrinks as
# detectors move to real signals or collectors learn to fill them; never grows silently.
SIMULATOR_ONLY_ALLOWED: dict[tuple[str, str, str], str] = {
    ("straggler", "rank_progress", "collective_wait_seconds"): (
        "written only by sim/cluster.py; the real hook reports step times and collective sequence numbers, not "
        "per-rank wait in collectives (straggler is being moved to step times)"
    ),
    ("fragmentation_allocator", "allocator_stats", "largest_free_block_bytes"): (
        "the hook's memory_stats has no largest free block (set null); only a memory snapshot read offline by "
        "analyze has it, so live the detector works from inactive_split_bytes and alloc retries"
    ),
}


def _modules_of(detector) -> list:
    """The detector's module, its classes' modules and the gpuvigil.detectors modules they import."""
    mods = {inspect.getmodule(c) for c in type(detector).__mro__ if c.__module__.startswith("gpuvigil.detectors")}
    for mod in list(mods):
        for node in ast.walk(ast.parse(inspect.getsource(mod))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("gpuvigil.detectors"):
                for alias in node.names:
                    name = f"{node.module}.{alias.name}"
                    mods.add(sys.modules.get(name) or sys.modules[node.module])
    return sorted((m for m in mods if m is not None), key=lambda m: m.__name__)


def _literals(module) -> set[str]:
    return {n.value for n in ast.walk(ast.parse(inspect.getsource(module))) if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def detector_reads(detector) -> dict[str, set[str]]:
    """stream -> columns the detector reads: its declared streams, look-backs and columns, plus
    every stream and column of those streams named in its code (and its detector helpers'): an
    over-approximation, so that a read cannot hide behind a helper."""
    lookback = dict(detector.lookback_seconds()) if callable(getattr(detector, "lookback_seconds", None)) else {}
    declared = dict(detector.window_columns()) if callable(getattr(detector, "window_columns", None)) else {}
    literals = set().union(*(_literals(m) for m in _modules_of(detector)))
    streams = {*getattr(detector, "streams", ()), *lookback, *declared} | (literals & set(signals.STREAM_SOURCES)) | ({"gpu_samples"} & literals)
    # A derived stream (rank_wait: the hook rows that carry a collective wait) reads its base stream.
    streams = {DERIVED[s][0] if s in DERIVED else s for s in streams}
    return {s: ({c for c in schemas.STREAMS[s] if c in literals} | set(declared.get(s, ()))) for s in sorted(streams)}


def _contract() -> tuple[dict[tuple[str, str, str], frozenset[str]], int]:
    table, n = {}, 0
    for d in default_detectors():
        for stream, cols in detector_reads(d).items():
            for c in sorted(cols):
                table[(d.name, stream, c)] = signals.column_sources(stream, c)
                n += 1
    return table, n


def test_every_column_a_detector_reads_has_a_real_source():
    table, n = _contract()
    assert n > 100  # the reads are really found (every detector, keys and signals)
    # spot checks of the scan: reads known from each detector's code
    for read in [("oom_device", "gpu_samples", "memory_used_bytes"), ("straggler_device", "gpu_samples", "sm_clock_mhz"), ("thermal", "gpu_samples", "throttle_reasons"), ("straggler", "rank_progress", "collective_wait_seconds"), ("hang_fr", "fr_analysis", "culprit_ranks")]:
        assert read in table, read
    simulator_only = {k for k, sources in table.items() if not sources}
    unexplained = sorted(simulator_only - set(SIMULATOR_ONLY_ALLOWED))
    assert not unexplained, f"detectors read columns that only the simulator fills: {unexplained}"
    stale = sorted(set(SIMULATOR_ONLY_ALLOWED) - simulator_only)
    assert not stale, f"no longer simulator-only (or no longer read): drop from SIMULATOR_ONLY_ALLOWED: {stale}"


# (detector, stream, column) that a real source fills only when configured beyond its defaults
# (dcgm-exporter's profiling fields must be added to its counters file): real, but worth seeing.
OPT_IN_ONLY: dict[tuple[str, str, str], str] = {
    ("hang_device", "gpu_samples", c): "a DCGM profiling field, absent from dcgm-exporter's default counters (hang_device falls back on util and power)"
    for c in ("nvlink_rx_bytes_per_second", "nvlink_tx_bytes_per_second", "sm_active_ratio", "tensor_active_ratio")
} | {
    ("nvlink_crc", "gpu_samples", "nvlink_crc_errors_total"): "dcgm-exporter's NVLink CRC fields are not among its default counters; without them nvlink_crc stays silent",
}


def test_reads_filled_only_when_a_source_is_configured_for_them_are_listed():
    table, _ = _contract()
    by_default = set(signals.DEFAULT_SOURCES)
    opt_in = {k for k, sources in table.items() if sources and not sources & by_default}
    assert opt_in == set(OPT_IN_ONLY)


def test_the_contract_check_catches_a_simulator_only_read():
    """A detector reading a column no real source fills is reported (the check cannot pass
    vacuously): one that reads rank_progress.collective_wait_seconds."""

    class Reads:
        name = "probe"
        streams = ("rank_progress",)

        def window_columns(self):
            return {"rank_progress": ("ts", "job", "rank", "collective_wait_seconds")}

    reads = detector_reads(Reads())
    assert "collective_wait_seconds" in reads["rank_progress"]
    assert signals.column_sources("rank_progress", "collective_wait_seconds") == frozenset()
    assert signals.column_sources("rank_progress", "step_time_seconds") == {"hook"}


@pytest.mark.parametrize("column", [s.name for s in signals.GPU_SIGNALS])
def test_each_gpu_column_names_its_real_sources_or_says_simulator_only(column):
    sources = signals.column_sources("gpu_samples", column)
    assert sources <= set(signals.SOURCES)
    sig = signals.BY_NAME[column]
    # a column with a DCGM field is real at least where dcgm-exporter is configured for it
    if sig.dcgm is not None:
        assert sources & {"dcgm", "dcgm_opt_in"}
    assert isinstance(sig.dtype, pl.DataType)
