"""Observation levels and the L0/L1 detectors on device telemetry, with numbers from public
incident reports (cited per test; /work/shared/research/device-signatures.md collects them)."""

from __future__ import annotations

import pytest

from gpuvigil import config, schemas
from gpuvigil.detectors.hang_device import DeviceHangDetector
from gpuvigil.pipeline.levels import LevelSelector
from gpuvigil.detectors.oom_device import DeviceOomPredictor
from gpuvigil.detectors.registry import default_detectors
from gpuvigil.detectors.straggler_device import DeviceStragglerDetector
from gpuvigil.model import Finding, FindingKind, Severity
from levels_helpers import allocations, cfg_with, gpu_rows, play, window

GIB = 1 << 30
NODE8 = [("n0", g) for g in range(8)]


# ---------------------------------------------------------------- level selection


def test_every_default_detector_declares_level_and_streams():
    dets = default_detectors(config.defaults())
    for d in dets:
        assert d.level in ("L0", "L1", "L2") and isinstance(d.streams, tuple) and d.streams, d.name
    caps = {(d.capability, d.level) for d in dets if d.capability}
    for cap in ("hang", "oom", "straggler"):
        assert (cap, "L0") in caps and (cap, "L2") in caps, cap
    assert ("hang", "L1") in caps and ("straggler", "L1") in caps


def _finding(job: str, source: str) -> Finding:
    return Finding(kind=FindingKind.COLLECTIVE_HANG, severity=Severity.PAGE, ts=0.0, job=job, summary="x", source=source)


@pytest.mark.parametrize(
    "streams, level, best",
    [
        ((), "L0", "hang_device"),
        (("collective_progress",), "L1", "hang_fr"),
        (("fr_pipes",), "L1", "hang_fr"),
        # The hook's allocator stats make the job L2, but the L2 hang detector reads rank progress:
        # for hangs the best this job allows is L1.
        (("fr_pipes", "allocator_stats"), "L2", "hang_fr"),
    ],
)
def test_job_level_is_the_best_stream_seen_and_lower_findings_are_suppressed(streams, level, best):
    dets = default_detectors(config.defaults())
    sel = LevelSelector(dets)
    w = window()
    w.add("allocations", allocations("j", NODE8))
    for s in streams:
        w.add(s, schemas.frame([{"ts": 10.0, "job": "j", "rank": 0}], s))
    w.seal(10.0)
    sel.observe(w)
    assert sel.job_levels() == {"j": level}
    by = {d.name: d for d in dets}
    # Detectors of the job's level and below (one above cannot report: it lacks the streams).
    names = ["hang_device", "hang_fr", "hang"][: ["hang_device", "hang_fr", "hang"].index(best) + 1]
    kept = {name: sel.select(by[name], [_finding("j", name)])[0] for name in names}
    assert [n for n, k in kept.items() if k] == [best]
    assert kept[best][0].evidence["level"] == by[best].level


def test_l0_finding_falls_back_when_l1_stays_silent():
    dets = default_detectors(config.defaults())
    by = {d.name: d for d in dets}
    sel = LevelSelector(dets, fallback_seconds={"L1": 60.0})
    for now in (10.0, 40.0, 71.0):
        w = window()
        w.add("allocations", allocations("j", NODE8))
        w.add("fr_pipes", schemas.frame([{"ts": now, "job": "j", "rank": 0}], schemas.FR_PIPES))
        w.seal(now)
        sel.observe(w)
        kept, dropped = sel.select(by["hang_device"], [_finding("j", "hang_device")])
    assert kept and kept[0].evidence["fallback_from"] == "L1"


def _l2_ticks(sel, times, stream="rank_progress"):
    for now in times:
        w = window()
        w.add("allocations", allocations("j", NODE8))
        w.add(stream, schemas.frame([{"ts": now, "job": "j", "rank": 0}], stream))
        w.seal(now)
        sel.observe(w)


def test_l2_job_hang_detectors_run_side_by_side_and_page_once():
    """L2 (the hook's rank progress): the hook's, the Flight Recorder's and the device's hang
    detectors all run; whichever is first pages, and the later ones go out as the same finding
    (one id: no second page) with their evidence joined."""
    dets = default_detectors(config.defaults())
    by = {d.name: d for d in dets}
    sel = LevelSelector(dets, **config.defaults()["levels"])
    _l2_ticks(sel, [10.0])
    assert sel.job_levels() == {"j": "L2"}
    assert sel.needed(by["hang_device"]) and sel.needed(by["hang_fr"]) and sel.needed(by["hang"])
    first = Finding(kind=FindingKind.COLLECTIVE_HANG, severity=Severity.PAGE, ts=10.0, job="j", summary="device", source="hang_device")
    kept, dropped = sel.select(by["hang_device"], [first])
    assert kept == [first] and not dropped and first.evidence["level"] == "L0"  # no fallback wait
    _l2_ticks(sel, [14.0])
    named = Finding(kind=FindingKind.COLLECTIVE_HANG, severity=Severity.PAGE, ts=14.0, job="j", ranks=[5], culprit_ranks=[5], summary="hook", source="hang")
    [out], _ = sel.select(by["hang"], [named])
    assert out.id == first.id and out.summary == "device" and out.source == "hang_device"
    assert out.culprit_ranks == [5] and out.evidence["culprit_from"] == "hang"
    assert out.evidence["joined"]["hang"] == {"level": "L2", "first_ts": 14.0, "culprit_ranks": [5], "summary": "hook"}
    # The paging detector goes on: its finding keeps the joined evidence.
    _l2_ticks(sel, [15.0])
    [again], _ = sel.select(by["hang_device"], [first.model_copy(update={"ts": 15.0})])
    assert again.id == first.id and again.culprit_ranks == [5] and "hang" in again.evidence["joined"]


def test_l2_hang_incident_ends_after_join_seconds():
    dets = default_detectors(config.defaults())
    by = {d.name: d for d in dets}
    sel = LevelSelector(dets, join_seconds=20.0)
    _l2_ticks(sel, [10.0])
    sel.select(by["hang_device"], [_finding("j", "hang_device")])
    _l2_ticks(sel, [31.0])  # 21 s without a report: a new incident, opened by the hook's finding
    [out], _ = sel.select(by["hang"], [_finding("j", "hang")])
    assert out.source == "hang" and "joined" not in out.evidence


def test_l2_job_lower_hang_finding_held_back_while_the_hook_sees_it_healthy():
    """The hook's rows show every collective completing: a device-side suspicion (a phase
    whose GPUs read like a hang) does not page."""
    dets = default_detectors(config.defaults())
    by = {d.name: d for d in dets}
    sel = LevelSelector(dets, **config.defaults()["levels"])
    _l2_ticks(sel, [10.0])
    by["hang"].healthy_jobs = {"j"}
    kept, dropped = sel.select(by["hang_device"], [_finding("j", "hang_device")])
    assert not kept and dropped
    by["hang"].healthy_jobs = set()
    kept, _ = sel.select(by["hang_device"], [_finding("j", "hang_device")])
    assert kept


def test_l2_job_hang_falls_back_to_l0_when_the_hook_names_nobody():
    """With side-by-side selection off (`side_by_side: []`) an L2 job's hang falls back instead:
    a rank stuck inside a kernel has enqueued the collective like its peers, the hook's
    counters show nobody missing and the L2 detector stays silent, while the GPUs show the job
    stopped. `L2.hang` (30 s): the L0 finding goes out after it, marked as a fallback."""
    dets = default_detectors(config.defaults())
    by = {d.name: d for d in dets}
    sel = LevelSelector(dets, **{**config.defaults()["levels"], "side_by_side": []})
    _l2_ticks(sel, [10.0])
    assert sel.job_levels() == {"j": "L2"}
    assert sel.needed(by["hang_device"]), "the L0 hang detector must run for an L2 job to fall back to it"
    kept, dropped = sel.select(by["hang_device"], [_finding("j", "hang_device")])
    assert not kept and dropped  # suppressed first: the hook may still speak
    _l2_ticks(sel, [39.0])
    assert not sel.select(by["hang_device"], [_finding("j", "hang_device")])[0]
    _l2_ticks(sel, [41.0])
    kept, _ = sel.select(by["hang_device"], [_finding("j", "hang_device")])
    assert kept and kept[0].evidence["fallback_from"] == "L2" and kept[0].evidence["level"] == "L0"


def test_l2_job_hang_does_not_fall_back_when_the_hook_spoke():
    dets = default_detectors(config.defaults())
    by = {d.name: d for d in dets}
    sel = LevelSelector(dets, **{**config.defaults()["levels"], "side_by_side": []})
    for now in (10.0, 30.0, 50.0, 70.0):
        _l2_ticks(sel, [now])
        assert sel.select(by["hang"], [_finding("j", "hang")])[0]  # the selected detector reports
        assert not sel.select(by["hang_device"], [_finding("j", "hang_device")])[0]


def test_l2_job_oom_never_falls_back_without_side_by_side():
    """Without side-by-side selection, L2's OOM figures stay the hook's own: no fallback."""
    dets = default_detectors(config.defaults())
    by = {d.name: d for d in dets}
    sel = LevelSelector(dets, **{**config.defaults()["levels"], "side_by_side": ["L2.hang"]})
    oom = lambda: Finding(kind=FindingKind.OOM_PREDICTED, severity=Severity.PAGE, ts=0.0, job="j", summary="x", source="oom_device")  # noqa: E731
    for now in (10.0, 100.0, 400.0):
        _l2_ticks(sel, [now], stream="allocator_stats")
        assert not sel.select(by["oom_device"], [oom()])[0]
    assert not sel.needed(by["oom_device"])


@pytest.mark.parametrize("cap, lower, hook", [("oom", "oom_device", "oom"), ("straggler", "straggler_device", "straggler")])
def test_l2_job_oom_and_straggler_run_side_by_side_by_default(cap, lower, hook):
    """By default an L2 job's device detector runs beside the hook's: its finding goes out at
    once (a hook publishing every few seconds, a growth over hours, a straggler that comes and
    goes are seen by the device first) and the hook's later one joins it as one finding."""
    dets = default_detectors(config.defaults())
    by = {d.name: d for d in dets}
    sel = LevelSelector(dets, **config.defaults()["levels"])
    kind = FindingKind.OOM_PREDICTED if cap == "oom" else FindingKind.STRAGGLER
    f = lambda src, ranks: Finding(kind=kind, severity=Severity.TICKET, ts=0.0, job="j", summary=src, source=src, culprit_ranks=ranks)  # noqa: E731

    def tick(now):
        w = window()
        w.add("allocations", allocations("j", NODE8))
        if cap == "oom":
            w.add("allocator_stats", schemas.frame([{"ts": now, "job": "j", "rank": 0}], "allocator_stats"))
        else:  # hook rows with a collective wait: the hook's straggler detector is the job's
            w.add("rank_progress", schemas.frame([{"ts": now, "job": "j", "rank": 0, "collective_wait_seconds": 0.1}], "rank_progress"))
        w.seal(now)
        sel.observe(w)

    tick(10.0)
    assert sel.best(cap, "j") == "L2" and sel.needed(by[lower])
    [first] = sel.select(by[lower], [f(lower, [3])])[0]
    assert first.source == lower and first.evidence["level"] == "L0"
    tick(20.0)
    [joined] = sel.select(by[hook], [f(hook, [3])])[0]
    assert joined.source == lower and joined.evidence["joined"][hook]["level"] == "L2"
    # While the hook's rows come often enough for its own fit, the device's finding is held back.
    by[hook].healthy_jobs = {"j"}
    tick(30.0)
    kept, dropped = sel.select(by[lower], [f(lower, [3])])
    assert kept == [] and len(dropped) == 1


@pytest.mark.parametrize("every, covered", [(1.0, True), (5.0, True), (15.0, False)])
def test_the_hook_s_oom_fit_covers_a_job_only_when_its_rows_come_often_enough(every, covered):
    """min_samples (8) over the fit window (90 s): rows every 15 s (a hook publishing at a 15 s
    pipeline tick) leave the job to the device's OOM detector beside it."""
    from gpuvigil.detectors.oom import OomPredictor

    det = OomPredictor(config.load())
    w = window()
    n = int(120 / every)
    w.add("allocator_stats", schemas.frame([{"ts": 1000.0 + i * every, "job": "j", "rank": r, "allocated_bytes": 1 << 30, "reserved_bytes": 2 << 30}
                                            for i in range(n) for r in range(4)], "allocator_stats"))
    w.seal(1000.0 + (n - 1) * every)
    det.detect(w)
    assert (det.healthy_jobs == {"j"}) is covered


# ---------------------------------------------------------------- L0 hang


def _hang_ticks(busy_w: float, waiting: dict, odd: dict, gpus=NODE8, seconds=60, healthy=60, **extra):
    """`healthy` s of training at `busy_w`, then the hang: every GPU reads `waiting` except the
    odd ones (gpu index → reading)."""
    alloc = allocations("job", gpus)
    for t in range(1, healthy + seconds + 1):
        rows = []
        for i, (n, g) in enumerate(gpus):
            if t <= healthy:
                r = {"util_ratio": 1.0, "power_w": busy_w, **extra}
            else:
                r = odd.get(i, waiting)
            rows.append({"node": n, "gpu": g, **r})
        yield float(t), {"gpu_samples": gpu_rows(float(t), rows), "allocations": alloc}


def test_accelerate_3104_the_one_gpu_at_zero_util_is_named():
    """huggingface/accelerate#3104: 8×H100, 7 GPUs at 100% util drawing 112–121 W, one at 0%
    (its rank was still in `forward`); healthy H100s draw 500–690 W (NVIDIA-NeMo#9291)."""
    waiting = {"util_ratio": 1.0, "power_w": 116.0}
    found = play(DeviceHangDetector(), _hang_ticks(600.0, waiting, {3: {"util_ratio": 0.0, "power_w": 113.0}}))
    assert found, "a hang was not raised"
    f = found[0]
    assert f.kind == FindingKind.COLLECTIVE_HANG and f.severity == Severity.PAGE
    assert f.culprit_ranks == [3] and f.gpu == 3 and f.cause == "software"
    assert f.evidence["level"] == "L0" and f.evidence["waiting_gpus"] == 7
    assert 25 <= f.ts - 60 <= 60  # after the hold, within a minute of onset


def test_nemo_9291_every_gpu_waits_alike_culprit_not_visible():
    """NVIDIA-NeMo#9291: every GPU of the job at 100% util and ~100 W of 700 W: the culprit is
    inside the device or network, which L0 cannot name."""
    found = play(DeviceHangDetector(), _hang_ticks(600.0, {"util_ratio": 1.0, "power_w": 100.0}, {}))
    assert found and found[0].culprit_ranks == [] and "cannot name" in found[0].summary


@pytest.mark.parametrize(
    "name, waiting",
    [
        # A checkpoint save or a data-loader stall: GPUs idle together (util drops with power).
        ("checkpoint", {"util_ratio": 0.04, "power_w": 130.0}),
        ("dataloader", {"util_ratio": 0.0, "power_w": 120.0}),
        # Evaluation: util stays high, but the GPUs still do work (power and SM activity stay up).
        ("evaluation", {"util_ratio": 0.9, "power_w": 380.0, "sm_active_ratio": 0.6, "tensor_active_ratio": 0.2}),
        # Low power at pinned util, but SM/tensor activity says real work runs: not a spin.
        ("busy_kernels", {"util_ratio": 1.0, "power_w": 200.0, "sm_active_ratio": 0.8, "tensor_active_ratio": 0.4}),
    ],
)
def test_hard_negatives_are_not_hangs(name, waiting):
    assert play(DeviceHangDetector(), _hang_ticks(600.0, waiting, {}, sm_active_ratio=0.8, tensor_active_ratio=0.4)) == []


def test_a_gpu_off_the_bus_is_the_culprit_with_hardware_cause():
    """rwth-i6/returnn#1484: during the all_reduce hang the lost GPU answers nothing."""
    found = play(DeviceHangDetector(), _hang_ticks(600.0, {"util_ratio": 1.0, "power_w": 150.0}, {5: {"util_ratio": None, "power_w": None}}))
    assert found and found[0].culprit_ranks == [5] and found[0].cause == "hardware"


# ---------------------------------------------------------------- L0 OOM


def _memory_ticks(own, foreign=None, seconds=200, procs=True, total=150_754_820_096):
    alloc = allocations("job", [("n0", 0), ("n0", 1)])
    for t in range(1, seconds + 1):
        o = own(t)
        f = foreign(t) if foreign else 0
        gs = gpu_rows(float(t), [{"node": "n0", "gpu": g, "memory_used_bytes": int(o + (f if g == 0 else 0)), "memory_total_bytes": total} for g in (0, 1)])
        frames = {"gpu_samples": gs, "allocations": alloc}
        if procs:
            rows = [{"ts": float(t), "node": "n0", "gpu": g, "pid": 100 + g, "used_memory_bytes": int(o), "job": "job", "rank": g} for g in (0, 1)]
            if f:
                rows.append({"ts": float(t), "node": "n0", "gpu": 0, "pid": 4242, "used_memory_bytes": int(f)})
            frames["gpu_processes"] = schemas.frame(rows, schemas.GPU_PROCESSES)
        yield float(t), frames


def test_leak_in_segment_steps_is_predicted_with_time_to_oom():
    # 1 GiB segments every 5 s from 60 GiB: 0.2 GiB/s, 140.4 − 1 − 60 GiB left → OOM ~ 400 s ahead.
    found = play(DeviceOomPredictor(), _memory_ticks(lambda t: 60 * GIB + (t // 5) * GIB))
    assert found
    f = found[0]
    assert f.kind == FindingKind.OOM_PREDICTED and f.cause == "leak" and f.evidence["level"] == "L0"
    assert f.evidence["fragmentation_visible"] is False and "fragmentation cannot be seen at L0" in f.summary
    true_left = (150_754_820_096 - (1 << 30) - f.evidence["gpu_used_bytes"]) / (0.2 * GIB)
    assert abs(f.evidence["time_to_oom_seconds"] - true_left) / true_left < 0.25


def test_flat_footprint_at_97_percent_with_a_sawtooth_inside_is_not_a_warning():
    """The allocator keeps its segments: a healthy job's footprint stays flat, even at 97%."""
    assert play(DeviceOomPredictor(), _memory_ticks(lambda t: int(0.97 * 140 * GIB))) == []


def test_another_process_growing_is_a_foreign_process():
    found = play(DeviceOomPredictor(), _memory_ticks(lambda t: 60 * GIB, foreign=lambda t: (t // 4) * GIB))
    assert found and found[0].cause == "foreign_process" and found[0].gpu == 0


def test_without_per_process_memory_growth_is_a_leak_or_capacity():
    """DCGM gives FB_USED only: another process's growth cannot be told from the job's."""
    found = play(DeviceOomPredictor(), _memory_ticks(lambda t: 60 * GIB, foreign=lambda t: (t // 4) * GIB, procs=False))
    assert found and found[0].cause == "leak" and found[0].evidence["per_process_memory"] is False
    assert "without per-process memory another process's growth cannot be told apart" in found[0].summary


def test_empty_cache_starts_the_envelope_over():
    # Grows for 60 s, empty_cache() drops 10 GiB, then flat: the drop resets the trend.
    own = lambda t: 60 * GIB + min(t, 60) // 5 * GIB - (10 * GIB if t > 60 else 0)  # noqa: E731
    found = play(DeviceOomPredictor(cfg_with("oom_device", fit_window_seconds=110.0)), _memory_ticks(own, seconds=200))
    assert not [f for f in found if f.ts > 70]


# ---------------------------------------------------------------- L0 straggler


def _straggler_ticks(culprit: dict, peers: dict, seconds=150):
    alloc = allocations("job", NODE8)
    for t in range(1, seconds + 1):
        rows = [{"node": n, "gpu": g, **(culprit if g == 2 else peers)} for n, g in NODE8]
        yield float(t), {"gpu_samples": gpu_rows(float(t), rows), "allocations": alloc}


def test_power_capped_gpu_with_a_lagging_clock_is_the_straggler():
    """Healthy spread in real jobs is ±60 MHz (Megatron-LM straggler log); 25% below is not."""
    found = play(
        DeviceStragglerDetector(),
        _straggler_ticks({"util_ratio": 0.97, "power_w": 520.0, "sm_clock_mhz": 1485.0}, {"util_ratio": 0.97, "power_w": 450.0, "sm_clock_mhz": 1965.0}),
    )
    assert found and found[0].culprit_ranks == [2] and found[0].cause == "device" and found[0].evidence["level"] == "L0"


def test_healthy_spread_is_not_a_straggler():
    """Megatron-LM's log line: 1950–1980 MHz, 97–100% util across ranks."""
    assert play(DeviceStragglerDetector(), _straggler_ticks({"util_ratio": 0.97, "power_w": 610.0, "sm_clock_mhz": 1950.0}, {"util_ratio": 1.0, "power_w": 680.0, "sm_clock_mhz": 1980.0})) == []


def test_findings_of_a_pipeline_carry_their_level():
    from gpuvigil.app.runtime import build_simulated

    cfg = config.load(overrides={"hints": {"rules": []}})
    rt = build_simulated("nccl_hang", cfg=cfg)
    rt.run(150.0)
    assert rt.pipeline.all_findings
    assert all(f.evidence.get("level") in ("L0", "L1", "L2") for f in rt.pipeline.all_findings)
    assert set(rt.last_result.job_levels.values()) == {"L2"}  # every simulated job runs the hook


def test_metrics_export_each_jobs_observation_level_and_serve_logs_it(caplog):
    import logging

    from gpuvigil.exporter.metrics import Snapshot
    from gpuvigil.app.runtime import build_simulated
    from gpuvigil.app.serve import Server

    rt = build_simulated("healthy", cfg=config.load(overrides={"hints": {"rules": []}}))
    rt.run(5.0)
    fam = {f.name: f for f in Snapshot(rt).families()}["gpuvigil_job_observation_level"]
    got = {dict(labels)["job"]: v for labels, v in fam.samples}
    assert got and all(v == 2.0 for v in got.values())
    server = Server.__new__(Server)  # only the level log: no sockets
    with caplog.at_level(logging.INFO, logger="gpuvigil.app.serve"):
        server._log_levels(rt.last_result)
        server._log_levels(rt.last_result)  # unchanged: logged once
    lines = [r.getMessage() for r in caplog.records if "observation level" in r.getMessage()]
    assert len(lines) == 1 and all(f"{job} L2" in lines[0] for job in got)


def test_dcgm_profiling_fields_reach_gpu_samples():
    """dcgm-exporter's DCP fields (names and units as in its default-counters.csv: ratios, bytes/s)."""
    from gpuvigil.collectors.dcgm import parse_text

    labels = 'gpu="0",UUID="GPU-1",pci_bus_id="00000000:18:00.0",device="nvidia0",modelName="NVIDIA H200",Hostname="n0"'
    text = "\n".join(
        f"# TYPE {n} gauge\n{n}{{{labels}}} {v}"
        for n, v in [
            ("DCGM_FI_DEV_GPU_UTIL", 100), ("DCGM_FI_DEV_POWER_USAGE", 118.5), ("DCGM_FI_DEV_FB_USED", 46000), ("DCGM_FI_DEV_FB_FREE", 96000), ("DCGM_FI_DEV_FB_RESERVED", 615),
            ("DCGM_FI_PROF_SM_ACTIVE", 0.18), ("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", 0.0), ("DCGM_FI_PROF_DRAM_ACTIVE", 0.01),
            ("DCGM_FI_PROF_PCIE_TX_BYTES", 2.5e6), ("DCGM_FI_PROF_PCIE_RX_BYTES", 1.5e6), ("DCGM_FI_PROF_NVLINK_TX_BYTES", 1.0e5), ("DCGM_FI_PROF_NVLINK_RX_BYTES", 2.0e5),
        ]
    )
    samples, _, _ = parse_text(text + "\n", ts=1.0)
    r = samples.row(0, named=True)
    assert r["sm_active_ratio"] == 0.18 and r["tensor_active_ratio"] == 0.0 and r["dram_active_ratio"] == 0.01
    assert r["pcie_tx_bytes_per_second"] == 2.5e6 and r["nvlink_rx_bytes_per_second"] == 2.0e5
    assert r["memory_reserved_bytes"] == 615 * (1 << 20) and r["util_ratio"] == 1.0


def _first_straggler_tick(detector) -> float | None:
    w = window()
    for now, frames in _straggler_ticks({"util_ratio": 0.97, "power_w": 520.0, "sm_clock_mhz": 1485.0}, {"util_ratio": 0.97, "power_w": 450.0, "sm_clock_mhz": 1965.0}):
        for stream, df in frames.items():
            w.add(stream, df)
        w.seal(now)
        if detector.detect(w):
            return now
    return None


def test_a_lag_must_persist_for_several_evaluations_before_it_is_a_straggler():
    """The persistence guard: one evaluation of lag is a blip, not a straggler (synthetic rows)."""
    at_once = _first_straggler_tick(DeviceStragglerDetector(cfg_with("straggler_device", persist_evaluations=1)))
    default = _first_straggler_tick(DeviceStragglerDetector())
    assert at_once is not None and default is not None
    # evaluated every tick (1 s): the default (3) waits for two more flagged evaluations
    assert default - at_once == pytest.approx(2.0)


@pytest.mark.parametrize(
    "flagged_per_evaluation, evaluations, kept",
    [
        ([[("j", 1)], [("j", 1)], [("j", 1)]], 3, [("j", 1)]),  # three in a row
        ([[("j", 1)], [("j", 1)]], 3, []),  # not yet
        ([[("j", 1)], [], [("j", 1)], [("j", 1)]], 3, []),  # a gap starts the count again
        ([[("j", 1), ("j", 2)], [("j", 2)], [("j", 1), ("j", 2)]], 2, [("j", 2)]),
        ([[("j", 1), ("j", 1)]], 1, [("j", 1), ("j", 1)]),  # rows of one rank count once per evaluation
    ],
)
def test_persistence_keeps_ranks_flagged_in_consecutive_evaluations(flagged_per_evaluation, evaluations, kept):
    """The shared persistence guard of the L0 and L1 straggler detectors."""
    import polars as pl

    from gpuvigil.detectors.common import Persistence

    p = Persistence()
    out = None
    for flagged in flagged_per_evaluation:
        frame = pl.DataFrame({"job": [j for j, _ in flagged], "rank": [r for _, r in flagged]}, schema={"job": pl.Utf8, "rank": pl.Int32})
        out = p.persistent(frame, evaluations)
    assert sorted(out.select("job", "rank").iter_rows()) == sorted(kept)


def test_l0_hang_renews_the_dump_asks_an_inspector_stall_used_up():
    """A checkpoint stops the collectives (Inspector stall: 2 asks, dumps show nothing pending)
    and the job hangs right after it, so the stall never ends. When the L0 hang finding arrives
    it is a new suspicion: the trigger asks again (found by `bench detectors`, where the L1
    finding otherwise came only from the 60 s L0 fallback)."""
    from gpuvigil.collectors.fr_dumps import FrDumpTrigger, FrRequests

    asked: list[float] = []
    now_box = [0.0]
    trig = FrDumpTrigger(lambda job: asked.append(now_box[0]) or True, FrRequests(), min_interval_seconds=5.0, stall_seconds=3.0)
    l0 = Finding(kind=FindingKind.COLLECTIVE_HANG, severity=Severity.PAGE, ts=0.0, job="j", summary="x", source="hang_device", evidence={"level": "L0"})

    class R:
        new_findings: list = []
        suppressed_findings: list = []

    w = window()
    for t in range(1, 61):
        now_box[0] = float(t)
        sn = min(t, 8) * 10  # stops completing at t=8, for good
        w.add("collective_progress", schemas.frame([{"ts": float(t), "job": "j", "rank": r, "coll_sn": sn} for r in range(4)], schemas.COLLECTIVE_PROGRESS))
        w.seal(float(t))
        R.now = float(t)
        R.suppressed_findings = [l0] if t >= 40 else []  # the L0 detector suspects a hang from t=40 on
        trig.on_tick(R, w)
    assert asked == [11.0, 16.0, 40.0, 45.0]


def test_a_transient_suspicion_long_ago_does_not_send_a_new_finding_out_at_once():
    """The fallback clock restarts when the suppressed findings stopped for longer than the
    fallback: the hook's detector gets its 30 s again for a new suspicion (side-by-side off)."""
    dets = default_detectors(config.defaults())
    by = {d.name: d for d in dets}
    sel = LevelSelector(dets, **{**config.defaults()["levels"], "side_by_side": []})
    _l2_ticks(sel, [10.0])
    assert not sel.select(by["hang_device"], [_finding("j", "hang_device")])[0]  # transient, then gone
    _l2_ticks(sel, [200.0])
    assert not sel.select(by["hang_device"], [_finding("j", "hang_device")])[0]  # new: suppressed first
    _l2_ticks(sel, [220.0])
    assert not sel.select(by["hang_device"], [_finding("j", "hang_device")])[0]
    _l2_ticks(sel, [231.0])
    kept, _ = sel.select(by["hang_device"], [_finding("j", "hang_device")])
    assert kept and kept[0].evidence["fallback_from"] == "L2"
