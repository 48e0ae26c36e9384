"""Every detector on real captured data, with assertions on meaning (kind, culprit, cause, lead
time). Each test names its input's source:

- H200: tests/data/h200/ (copied unedited from a real NVIDIA H200 capture, see its README):
  the OOM messages, `memory_stats()` of the allocation ramp and of the fragmentation OOM, the NVML
  time series;
- public: tests/data/public/ (lines copied unchanged from public GitHub threads, see its README);
- Slurm: tests/data/slurm/ (output recorded from a real slurmctld, see tests/test_slurm_parse.py);
- gloo: real multi-rank training runs started by this test (tests/rank_workers.py): four CPU
  ranks on torch.distributed/gloo with the in-process hook publishing and the Flight Recorder
  recording; one rank hangs, dies or computes slower.

Detectors with no real input here (said in their docstrings and in docs/testing.md): the peer
anomaly model (needs >= 4 GPUs of one job; the capture has one GPU) and the PCIe replay rate (the
capture's replay counter is 0 and never moves). Their positives are tested on the simulator only.

Where a detector's time constants are scaled to a capture's pace (a CPU job with 0.03 s steps, an
allocation ramp of 5 s) the test says so: thresholds are configuration, the logic is the same.
"""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest

from gpuvigil import config, schemas
from gpuvigil.detectors.ecc import EccDetector
from gpuvigil.detectors.fragmentation_allocator import AllocatorFragmentationDetector
from gpuvigil.detectors.fragmentation_cluster import ClusterFragmentationDetector
from gpuvigil.detectors.hang import HangDetector
from gpuvigil.detectors.oom import OomPredictor
from gpuvigil.detectors.oom_events import OomEventClassifier
from gpuvigil.detectors.straggler import StragglerDetector
from gpuvigil.detectors.thermal import ThermalDetector
from gpuvigil.detectors.xid import XidDetector
from gpuvigil.window import Window

DATA = Path(__file__).parent / "data"
H200 = DATA / "h200"
PUBLIC = DATA / "public"
GIB = 1 << 30
MIB = 1 << 20
# torch.cuda.mem_get_info()'s total on the captured H200 (tests/data/h200/nvml_inventory.json).
H200_TOTAL = int(json.loads((H200 / "nvml_inventory.json").read_text())["memory"]["total"])


def _cfg(**blocks) -> dict:
    return config.load(overrides={"detectors": blocks}) if blocks else config.defaults()


def _window_of(frames: dict[str, pl.DataFrame], now: float) -> Window:
    w = Window(1e10)  # keep every row: some inputs span years
    for stream, df in frames.items():
        w.add(stream, df)
    w.seal(now)
    return w


def _replay(detector, stream: str, rows: pl.DataFrame, tick: float, extra: dict[str, pl.DataFrame] | None = None) -> list[tuple[float, list]]:
    """Feed `rows` to `detector` tick by tick, in their own time order; [(tick time, findings)]."""
    rows = rows.sort("ts")
    w = Window(3600.0)
    t = float(rows["ts"].min())
    end = float(rows["ts"].max())
    out = []
    first = True
    while t <= end + tick:
        part = rows.filter((pl.col("ts") > t - tick) & (pl.col("ts") <= t)) if not first else rows.filter(pl.col("ts") <= t)
        first = False
        if part.height:
            w.add(stream, part)
        for s, df in (extra or {}).items():
            w.add(s, df)
        w.seal(t)
        out.append((t, detector.detect(w)))
        t += tick
    return out


# -- OOM after the fact: the classifier on real messages, read by the real log collector ------------


def _oom_events(path: Path) -> pl.DataFrame:
    from gpuvigil.collectors.nccl_log import NcclLogCollector

    frames = NcclLogCollector(path, node="h200-0", job="train").collect(0.0)
    return frames.get("events", schemas.empty("events"))


@pytest.mark.parametrize(
    "name, kind, requested, unallocated",
    [
        # H200: 4 GiB blocks until the device is full: a real capacity OOM, nothing held unused.
        ("s2_oom_ramp.log", "oom_capacity", 4 * GIB, 0),
        # H200: 60 split 1 GiB segments, then an 8 GiB request fails with 24 GiB reserved but unallocated.
        ("s3_fragmentation.log", "oom_fragmentation", 8 * GIB, 24 * GIB),
    ],
)
def test_oom_classifier_on_real_h200_ooms(name, kind, requested, unallocated):
    ev = _oom_events(H200 / name)
    assert ev.filter(pl.col("kind") == "oom").height == 1
    [f] = OomEventClassifier().detect(_window_of({"events": ev}, float(ev["ts"].max()) + 1))
    assert (f.kind.value, f.severity.value, f.cause, f.job, f.node) == (kind, "page", kind.removeprefix("oom_"), "train", "h200-0")
    assert f.evidence["requested_bytes"] == requested
    assert f.evidence["total_bytes"] == pytest.approx(139.80 * GIB, rel=1e-3)
    assert abs(f.evidence["reserved_unallocated_bytes"] - unallocated) < 0.01 * GIB
    assert f.evidence["foreign_bytes"] < GIB  # only the CUDA context outside PyTorch


def test_oom_classifier_on_public_wordings():
    """public: oom_wordings.log, seven real messages from torch 1.2 to 2.x (old `cached` and
    `reserved in total` wordings, the `capacty` typo, `Process N has`, `0 bytes is free`)."""
    ev = _oom_events(PUBLIC / "oom_wordings.log")
    findings = OomEventClassifier().detect(_window_of({"events": ev}, float(ev["ts"].max()) + 1))
    assert [round(f.evidence["requested_bytes"] / MIB, 2) for f in findings] == [50.0, 2314.24, 32.0, 496.0, 1740.8, 226.0, 3072.0]
    # Lines 1-2: far more was free than asked (3.91 GiB free for 50 MiB...): the figures do not
    # explain the OOM. Line 3: 41.56 MiB free for 32 MiB, within the headroom the driver keeps: a
    # full device. Line 4: 235 MiB free and 330 MiB cached in pieces, each less than the 496 MiB
    # asked (the cache and the free memory are never added up): capacity. Lines 5-7: PyTorch's
    # reserved-but-unallocated cache alone covers the request (e.g. 2.30 GiB cached, 1.70 GiB
    # asked): fragmentation.
    assert [f.kind.value for f in findings] == ["oom_unexplained"] * 2 + ["oom_capacity"] * 2 + ["oom_fragmentation"] * 3
    assert findings[2].evidence["requested_bytes"] <= findings[2].evidence["free_bytes"]
    assert findings[3].evidence["reserved_unallocated_bytes"] < findings[3].evidence["requested_bytes"]
    for f in findings[4:]:
        assert f.evidence["free_bytes"] < f.evidence["requested_bytes"] <= f.evidence["reserved_unallocated_bytes"]
    assert all(f.severity.value == "page" for f in findings)


# -- OOM before it happens: the predictor on the real allocation ramp ------------------------------


def _s2_ramp() -> tuple[pl.DataFrame, float]:
    """H200: s2_memory_stats.json `stats_before`, the allocator's real readings (allocated,
    reserved, wall time) after each 4 GiB allocation of the ramp that ended in the real OOM.
    Returns allocator_stats rows and when the OOM happened (the next allocation, one interval on)."""
    ramp = json.loads((H200 / "s2_memory_stats.json").read_text())["stats_before"]
    rows = [
        {"ts": r["t"], "job": "ramp", "rank": 0, "node": "h200-0", "gpu": 0, "allocated_bytes": r["allocated"], "reserved_bytes": r["reserved"],
         "peak_allocated_bytes": r["allocated"], "alloc_retries": 0, "oom_count": 0, "device_capacity_bytes": H200_TOTAL, "foreign_used_bytes": 0}
        for r in ramp
    ]
    ts = [r["t"] for r in ramp]
    step = (ts[-1] - ts[0]) / (len(ts) - 1)
    return schemas.frame(rows, schemas.ALLOCATOR_STATS), ts[-1] + step


def test_oom_predictor_warns_before_the_real_h200_oom():
    """The ramp takes 5 s (28 GiB/s), so the predictor's time constants are divided by 20 (fit
    over 4.5 s, >= 2 s span, horizon 90 s); growth and headroom thresholds are the defaults."""
    rows, t_oom = _s2_ramp()
    det = OomPredictor(_cfg(oom={"fit_window_seconds": 4.5, "warmup_seconds": 0.0, "min_samples": 8, "min_span_seconds": 2.0, "predict_horizon_seconds": 90.0, "page_within_seconds": 45.0}))
    fired = [(t, fs) for t, fs in _replay(det, "allocator_stats", rows, tick=0.1) if fs]
    assert fired, "no warning before the real OOM"
    t, [f] = fired[0]
    lead = t_oom - t
    assert (f.kind.value, f.cause, f.job, f.ranks, f.severity.value) == ("oom_predicted", "leak", "ramp", [0], "page")
    assert lead >= 1.0, f"warned only {lead:.2f} s before the OOM"
    # The predicted time to OOM is the real one, within the safety margin's worth of growth.
    growth = f.evidence["growth_bytes_per_second"]
    assert growth == pytest.approx(4 * GIB / ((t_oom - float(rows["ts"].min())) / len(rows)), rel=0.1)
    assert abs(f.evidence["time_to_oom_seconds"] - lead) <= 1.5 * GIB / growth + 0.2
    assert f.evidence["reserved_unallocated_bytes"] == 0


# -- allocator fragmentation on the real fragmentation OOM ------------------------------------------


def _stats_rows(series: list[tuple[float, dict]], job: str) -> pl.DataFrame:
    rows = [
        {"ts": ts, "job": job, "rank": 0, "node": "h200-0", "gpu": 0,
         "allocated_bytes": s.get("allocated_bytes.all.current", 0), "reserved_bytes": s.get("reserved_bytes.all.current", 0),
         "inactive_split_bytes": s.get("inactive_split_bytes.all.current", 0), "peak_allocated_bytes": s.get("allocated_bytes.all.peak", 0),
         "alloc_retries": s.get("num_alloc_retries", 0), "oom_count": s.get("num_ooms", 0), "device_capacity_bytes": H200_TOTAL, "foreign_used_bytes": 0}
        for ts, s in series
    ]
    return schemas.frame(rows, schemas.ALLOCATOR_STATS)


def _capture_series(prefix: str) -> pl.DataFrame:
    """H200: the process's allocator as its hook would publish it once a second: empty at start
    (every process's allocator is), then the real `memory_stats()` before the 8 GiB request
    (`<prefix>_memory_stats_before.json`) and after it (`..._after.json`)."""
    before = json.loads((H200 / f"{prefix}_memory_stats_before.json").read_text())
    after = json.loads((H200 / f"{prefix}_memory_stats_after.json").read_text())
    series = [(float(t), {}) for t in range(4)] + [(float(t), before) for t in range(4, 8)] + [(float(t), after) for t in range(8, 12)]
    return _stats_rows(series, prefix)


def test_allocator_fragmentation_on_the_real_fragmentation_oom():
    det = AllocatorFragmentationDetector(_cfg(fragmentation_allocator={"warmup_seconds": 0.0, "every_seconds": 0.0}))
    found = [f for _, fs in _replay(det, "allocator_stats", _capture_series("s3"), tick=1.0) for f in fs]
    assert found, "the real fragmentation OOM raised no fragmentation finding"
    f = found[0]
    assert (f.kind.value, f.cause, f.job, f.ranks, f.severity.value) == ("fragmentation_allocator", "fragmentation", "s3", [0], "ticket")
    assert abs(f.evidence["reserved_unused_bytes"] - 24 * GIB) < 0.01 * GIB
    assert f.evidence["inactive_split_bytes"] >= 0.99 * f.evidence["reserved_unused_bytes"]
    assert f.evidence["alloc_retries_delta"] == 1
    assert f.ts == 8.0  # the tick the retry shows up: the real stats before it had no retry yet


def test_expandable_segments_run_is_not_fragmentation():
    """H200: s4, the same program with expandable_segments:True: no slivers, no OOM, no finding."""
    det = AllocatorFragmentationDetector(_cfg(fragmentation_allocator={"warmup_seconds": 0.0, "every_seconds": 0.0}))
    assert [fs for _, fs in _replay(det, "allocator_stats", _capture_series("s4"), tick=1.0) if fs] == []


# -- thermal, PCIe: the real H200 NVML series (a hard negative) -------------------------------------


def test_real_h200_series_raises_no_thermal_or_pcie_finding():
    """H200: nvml_timeseries.csv (80 s: idle, matmul at full power, OOM ramps, NCCL runs). The clock
    event reasons are 0x0, 0x1 (idle) and 0x4 (application clocks): never heat or power."""
    from gpuvigil.collectors.nvml import replay_csv
    from gpuvigil.detectors.pcie import PcieReplayDetector

    samples = replay_csv(H200 / "nvml_timeseries.csv", node="h200-0")
    assert set(samples["throttle_reasons"].unique().to_list()) == {0, 1, 4}
    assert samples["power_w"].max() > 500  # the matmul phase really loaded the GPU
    thermal = _replay(ThermalDetector(), "gpu_samples", samples, tick=1.0)
    pcie = _replay(PcieReplayDetector(), "gpu_samples", samples, tick=1.0)
    assert [fs for _, fs in thermal if fs] == [] and [fs for _, fs in pcie if fs] == []


# -- XID and ECC: public kernel logs through the real kernel-log collector ----------------------------


def _kernel_events(name: str) -> pl.DataFrame:
    from gpuvigil.collectors.kernel_log import KernelLogCollector

    col = KernelLogCollector(PUBLIC / name, node="node-a", from_start=True, state_file="", boot_ts=1796000000.0)
    return col.collect(0.0).get("events", schemas.empty("events"))


@pytest.mark.parametrize(
    "name, expected",
    [
        # public: leptonai/gpud#46, a burst of XID 13 (application error) and an XID 109.
        ("kernel_xids.log", {13: ("ticket", "software", 3), 109: ("page", "hardware", 1)}),
        # public: XID 79 (fallen off the bus) pages; 31, 32 (application/driver) and 3 do not.
        ("kernel_fallen_off_bus.log", {79: ("page", "hardware", 1), 31: ("ticket", "software", 1), 32: ("ticket", "software", 1), 3: ("ticket", None, 1)}),
    ],
)
def test_xid_detector_on_public_kernel_logs(name, expected):
    ev = _kernel_events(name)
    # The lines come from threads years apart: report every one of them, however old.
    found = XidDetector(_cfg(xid={"report_seconds": 1e10})).detect(_window_of({"events": ev}, float(ev["ts"].max()) + 1))
    got = {f.xid: (f.severity.value, f.cause, f.evidence["count"]) for f in found}
    assert got == expected
    assert all(f.kind.value == "xid" for f in found)


def test_ecc_detector_on_a_public_dbe_log():
    """public: NVIDIA/gpu-operator#1146, an XID 48 double-bit ECC error with XID 64 (remap
    failure) on one GPU: one page, of the failed remap's kind (NVIDIA's RMA criterion), both XIDs
    its evidence; the XID detector leaves memory errors to the ECC detector."""
    ev = _kernel_events("kernel_dbe_syslog.log")
    w = _window_of({"events": ev}, float(ev["ts"].max()) + 1)
    [f] = EccDetector().detect(w)
    assert (f.kind.value, f.severity.value, f.cause, f.xid, f.evidence["xids"]) == ("row_remap_failure", "page", "hardware", 48, [48, 64])
    assert XidDetector().detect(w) == []


# -- cluster fragmentation: a real Slurm state --------------------------------------------------------


def test_real_slurm_state_is_not_cluster_fragmentation():
    """Slurm: the recorded cluster (job 6 waits for 4 GPUs, on no node constraint, while one node is
    drained): what blocks it is not scattered GPUs, so no compaction is proposed."""
    from gpuvigil.scheduler.slurm import SlurmState, SlurmStateCollector

    class Recorded:
        def run(self, *argv):
            name = {"squeue": "squeue.json", "sinfo": "sinfo.json"}.get(argv[0]) if "--json" in argv else {"job": "scontrol_show_job.txt", "node": "scontrol_show_node.txt"}[argv[-1]]
            return (DATA / "slurm" / name).read_text()

        def run_json(self, *argv):
            return json.loads(self.run(*argv))

    frames = SlurmStateCollector(SlurmState(Recorded(), use_json=True)).collect(1800000000.0)
    assert frames["jobs"].filter(pl.col("state") == "pending")["job"].to_list() == ["6"]
    assert ClusterFragmentationDetector().detect(_window_of(frames, 1800000000.0)) == []
    # The same real cluster with job 6 asking for 4 GPUs on one node: node gvnode1 has 5 free, so
    # it fits and is still not fragmentation; asking 6 per node, it is blocked by capacity
    # (5 free in all), not by scatter.
    for per_node in (4, 6):
        jobs = frames["jobs"].with_columns(pl.when(pl.col("job") == "6").then(per_node).otherwise(pl.col("gpus_per_node")).alias("gpus_per_node"),
                                           pl.when(pl.col("job") == "6").then(per_node).otherwise(pl.col("n_gpus")).alias("n_gpus"))
        assert ClusterFragmentationDetector().detect(_window_of({**frames, "jobs": jobs}, 1800000000.0)) == []


# -- collective hang and straggler: real gloo ranks, through the hook and the Flight Recorder ------------


@pytest.fixture(scope="module")
def gloo(tmp_path_factory):
    pytest.importorskip("torch")
    import rank_workers as rw

    root = tmp_path_factory.mktemp("gloo")
    return rw.run_worlds(root, [rw.World("hang", culprit=2), rw.World("slow", culprit=1), rw.World("dead", culprit=3)])


def _hook_rows(folder: Path) -> pl.DataFrame:
    from gpuvigil.collectors.hook import HookCollector

    return HookCollector([folder / "hook"]).collect(0.0)["rank_progress"]


# A CPU job with 0.03 s steps: the hang detector's floors (5 s) are scaled to 1 s.
HANG_CFG = {"hang": {"min_stall_seconds": 1.0, "stale_report_seconds": 1.0}}


def _first_hang(folder: Path) -> tuple[float, object] | None:
    det = HangDetector(_cfg(**HANG_CFG))
    return next(((t, fs[0]) for t, fs in _replay(det, "rank_progress", _hook_rows(folder), tick=0.25) if fs), None)


@pytest.mark.torch
def test_hook_names_the_rank_that_stopped_entering_collectives(gloo):
    fault_ts = json.loads((gloo["hang"] / "wall.json").read_text())["fault_ts"]
    hit = _first_hang(gloo["hang"])
    assert hit is not None, "no hang found in a real hung all_reduce"
    t, f = hit
    assert (f.kind.value, f.severity.value, f.cause, f.culprit_ranks, f.node, f.gpu) == ("collective_hang", "page", "software", [2], "node1", 0)
    assert f.evidence["pending_seq"] == 31 and f.evidence["op"] == "all_reduce" and f.evidence["waiting_ranks"] == 3
    assert f.evidence["silent_ranks"] == []
    # Found within the scaled stall floor (1 s) plus two ticks and a hook interval of the fault.
    assert fault_ts < t <= fault_ts + 1.0 + 0.5 + 0.2, t - fault_ts


@pytest.mark.torch
def test_hook_names_the_rank_that_died(gloo):
    hit = _first_hang(gloo["dead"])
    assert hit is not None, "no hang found when a rank died"
    _, f = hit
    assert (f.kind.value, f.culprit_ranks, f.node, f.gpu) == ("collective_hang", [3], "node1", 1)
    assert f.evidence["silent_ranks"] == [3]


@pytest.mark.torch
def test_a_slow_rank_is_not_a_hang(gloo):
    assert _first_hang(gloo["slow"]) is None


@pytest.mark.torch
@pytest.mark.parametrize("scenario, culprit", [("hang", 2), ("dead", 3)])
def test_flight_recorder_names_the_culprit(gloo, scenario, culprit):
    from gpuvigil.collectors import flight_recorder as fr
    from gpuvigil.offline import fr as offline_fr

    [f] = offline_fr.analyze_dumps([fr.load_dump(gloo[scenario] / f"fr_rank_{r}") for r in range(4)], job=scenario)
    assert (f.kind.value, f.culprit_ranks, f.evidence["collective_seq_id"], f.evidence["op"]) == ("collective_hang", [culprit], 31, "all_reduce")


@pytest.mark.torch
def test_flight_recorder_of_a_slow_run_shows_no_hang(gloo):
    from gpuvigil.collectors import flight_recorder as fr
    from gpuvigil.offline import fr as offline_fr

    assert offline_fr.analyze_dumps([fr.load_dump(gloo["slow"] / f"fr_rank_{r}") for r in range(4)], job="slow") == []


def _waits_from_flight_recorder(folder: Path, world: int = 4) -> pl.DataFrame:
    """rank_progress rows with each rank's time blocked in every all_reduce, from the real Flight
    Recorder dumps: a rank waits from when it enqueued collective k until the last rank enqueued
    it (gloo records no completion times; NCCL's would give the same). No gpuvigil collector emits
    collective wait yet (the hook does not): this is the test's own reading of the dumps."""
    from gpuvigil.collectors import flight_recorder as fr

    created: dict[int, dict[int, float]] = {}
    for r in range(world):
        for e in fr.load_dump(folder / f"fr_rank_{r}").entries:
            if e.op == "all_reduce" and e.time_created_ns:
                created.setdefault(e.collective_seq_id, {})[r] = e.time_created_ns / 1e9
    seqs = sorted(k for k, v in created.items() if len(v) == world)
    rows = []
    for prev, k in zip(seqs, seqs[1:]):
        last = max(created[k].values())
        step = last - max(created[prev].values())
        for r, t in created[k].items():
            rows.append({"ts": last, "job": folder.name, "rank": r, "node": f"node{r // 2}", "gpu": r % 2, "pg": "0", "last_enqueued_seq": k,
                         "last_completed_seq": k, "step": k, "step_time_seconds": step, "collective_wait_seconds": last - t})
    return schemas.frame(rows, schemas.RANK_PROGRESS)


@pytest.mark.torch
def test_straggler_from_real_flight_recorder_timings(gloo):
    rows = _waits_from_flight_recorder(gloo["slow"])
    assert rows["rank"].n_unique() == 4 and rows.height >= 4 * 25
    f = None
    for _, fs in _replay(StragglerDetector(), "rank_progress", rows, tick=0.25):
        f = f or (fs[0] if fs else None)
    assert f is not None, "the rank computing twice as long was not named"
    assert (f.kind.value, f.culprit_ranks, f.node, f.gpu, f.severity.value) == ("straggler", [1], "node0", 1, "ticket")
    # It computes 2x as long (0.06 s vs 0.03 s of sleep per step, plus the same all_reduce).
    assert 1.4 <= f.evidence["slowdown"] <= 2.6, f.evidence


@pytest.mark.torch
def test_healthy_real_steps_have_no_straggler(gloo):
    """gloo: the 30 healthy steps of the `hang` run (every rank computes alike) name nobody."""
    rows = _waits_from_flight_recorder(gloo["hang"])
    assert rows.height >= 4 * 25
    assert [fs for _, fs in _replay(StragglerDetector(), "rank_progress", rows, tick=0.25) if fs] == []


@pytest.mark.torch
def test_real_hook_rows_of_a_slow_rank_leave_its_stragglers_to_the_device_detectors(gloo):
    """The real hook on real gloo ranks (rank 1 computing twice as long): its rows carry no
    collective wait, and gloo records no kernel starts, which the hook sends as unknown (null,
    with collective_starts false; the Flight Recorder's -1 would read "nothing started"). The L2 straggler
    detector, which needs the wait, is not the one the level selection runs for this L2 job:
    its stragglers are left to the L1/L0 detectors (on GPUs, straggler_device reads the slow
    rank's clock; these CPU ranks have no device telemetry)."""
    from gpuvigil.pipeline.levels import LevelSelector
    from gpuvigil.detectors.registry import default_detectors

    rows = _hook_rows(gloo["slow"])
    assert rows["rank"].n_unique() == 4 and rows.height >= 4 * 10
    assert rows["collective_wait_seconds"].null_count() == rows.height
    assert rows["last_started_seq"].null_count() == rows.height
    assert StragglerDetector().detect(_window_with(rows)) == []  # what the L2 detector alone gives
    dets = default_detectors(config.defaults())
    by = {d.name: d for d in dets}
    sel = LevelSelector(dets)
    w = _window_with(rows)
    sel.observe(w)
    job = rows["job"][0]
    assert sel.job_levels() == {job: "L2"}
    assert (sel.best("straggler", job), sel.best("hang", job)) == ("L0", "L2")
    assert sel.needed(by["straggler_device"]) and not sel.needed(by["straggler"])


def _window_with(rows: pl.DataFrame) -> Window:
    w = Window(1e9)
    w.add("rank_progress", rows)
    w.seal(float(rows["ts"].max()))
    return w
