"""What the simulated cluster's sources send: per-node device sample clocks (dcgm-exporter at 30 s,
NVML at 1 s), lost, late and drifting samples, the in-process hook's publishing modes, logs
without job names, stragglers that come and go, and scenarios of hours that cost ticks, not
wall time. The world itself (jobs, faults, readings) must not depend on how it is sampled."""

from __future__ import annotations

import json
import subprocess
import sys

import polars as pl
import pytest

from gpuvigil.errors import UserError
from gpuvigil.sim import scenario as scenario_mod
from gpuvigil.sim.cluster import SimulatedCluster
from gpuvigil.sim.sources import DeviceSampler

FAST = {
    "name": "t",
    "duration_seconds": 400,
    "nodes": 4,
    "jobs": [{"name": "train", "gpus": 16, "gpus_per_node": 8, "step_time_seconds": 1.2, "memory_base_gib": 40, "memory_peak_gib": 95}],
}


def _scenario(**kw) -> scenario_mod.Scenario:
    return scenario_mod.Scenario.model_validate({**FAST, **kw})


def _observe(sc: scenario_mod.Scenario, until: float, tick: float = 1.0, seed: int = 0) -> dict[str, pl.DataFrame]:
    """Every stream's rows over [tick, until], each tagged with the tick it was delivered on."""
    from gpuvigil.scheduler.core import Scheduler
    from gpuvigil.sim.cluster import node_specs

    sched = Scheduler(node_specs(sc))
    cluster = SimulatedCluster(sc, sched, seed=seed)
    sched.cycle(0.0)
    out: dict[str, list[pl.DataFrame]] = {}
    t = 0.0
    while t + tick <= until + 1e-9:
        t += tick
        for stream, df in cluster.observe(t).items():
            out.setdefault(stream, []).append(df.with_columns(pl.lit(t).alias("delivered")))
        sched.cycle(t)
    return {s: pl.concat(dfs, how="vertical_relaxed") for s, dfs in out.items()}


def _gaps(gs: pl.DataFrame) -> pl.DataFrame:
    """Seconds between a node's consecutive samples (one row per node sample)."""
    per_node = gs.group_by("node", "ts").agg(pl.len()).sort("node", "ts")
    return per_node.with_columns(pl.col("ts").diff().over("node").alias("gap")).drop_nulls("gap")


# -- device sample clocks -------------------------------------------------------------------------


def test_default_sources_send_every_tick_as_before():
    rows = _observe(_scenario(), 30)
    gs = rows["gpu_samples"]
    assert gs.height == 30 * 32 and (gs["ts"] == gs["delivered"]).all()
    assert rows["rank_progress"].group_by("delivered").len()["len"].to_list() == [16] * 30


def test_prometheus_history_at_30s_each_node_on_its_own_phase():
    gs = _observe(_scenario(sources={"device_seconds": 30, "device_mode": "history"}), 300)["gpu_samples"]
    gaps = _gaps(gs)
    assert (gaps["gap"] == 30).all(), gaps["gap"].unique().to_list()
    per_node = gs.group_by("node").agg(pl.col("ts").n_unique().alias("n"), pl.col("ts").min().alias("first"))
    assert per_node["n"].to_list() == [10] * 4, "300 s at 30 s: ten samples a node"
    # Exporters are not in step: the nodes' first samples fall on different ticks.
    assert per_node["first"].n_unique() > 1 and (per_node["first"] <= 30).all()
    # A sample holds all 8 GPUs of its node, taken when it is delivered.
    assert (gs.group_by("node", "ts").len()["len"] == 8).all() and (gs["ts"] == gs["delivered"]).all()


def test_a_tick_coarser_than_the_interval_yields_one_sample_a_tick():
    gs = _observe(_scenario(sources={"device_seconds": 10, "device_mode": "history"}), 300, tick=30)["gpu_samples"]
    assert (_gaps(gs)["gap"] == 30).all()


def test_sampling_does_not_change_the_world():
    """The same run sampled at 1 s and at 30 s: every 30 s row is the 1 s row of that tick
    (the sampler draws from its own random stream), and the hook's rows are identical."""
    every = _observe(_scenario(faults=[{"type": "memory_leak", "at": 60, "job": "train", "ranks": [3], "leak_gib_per_step": 0.2}]), 240)
    sparse = _observe(
        _scenario(faults=[{"type": "memory_leak", "at": 60, "job": "train", "ranks": [3], "leak_gib_per_step": 0.2}], sources={"device_seconds": 30, "device_mode": "history"}), 240
    )
    key = ["ts", "node", "gpu"]
    joined = sparse["gpu_samples"].join(every["gpu_samples"], on=key, how="left", suffix="_1s")
    assert joined.height == sparse["gpu_samples"].height
    for col in ("memory_used_bytes", "power_w", "temperature_c", "util_ratio"):
        assert (joined[col] == joined[f"{col}_1s"]).all(), col
    assert sparse["allocator_stats"].drop("delivered").equals(every["allocator_stats"].drop("delivered"))


def test_lost_late_and_drifting_samples():
    sampler = DeviceSampler([f"n{i}" for i in range(20)], 30.0, drop_share=0.1, late_share=0.2, late_seconds=(5.0, 60.0), jitter=3.0, seed=4, mode="history")
    got = []
    for t in range(1, 3601):
        frame = pl.DataFrame({"ts": [float(t)] * 20, "node": [f"n{i}" for i in range(20)], "gpu": list(range(20))})
        out = sampler.deliver(float(t), {"gpu_samples": frame})["gpu_samples"]
        got.append(out.with_columns(pl.lit(float(t)).alias("delivered")))
    rows = pl.concat(got)
    taken = sampler.delivered + sampler.dropped
    assert 20 * 110 <= taken <= 20 * 130, taken  # about 120 samples a node in an hour at 30 ± 3 s
    assert 0.06 < sampler.dropped / taken < 0.14 and 0.15 < sampler.late / taken < 0.25
    assert rows.height == sampler.delivered - sum(1 for h in sampler._held)
    late = rows.filter(pl.col("delivered") > pl.col("ts"))
    assert late.height > 0 and late.select((pl.col("delivered") - pl.col("ts")).is_between(5, 61).all()).item()
    # A late sample arrives after newer samples of other nodes: out of order on the wire.
    assert (rows["ts"].diff().drop_nulls() < 0).any()
    # Intervals drift within the jitter (a tick of 1 s on top), and drops leave wider gaps.
    gaps = rows.sort("node", "ts").with_columns(pl.col("ts").diff().over("node").alias("gap")).drop_nulls("gap")["gap"]
    assert gaps.min() >= 26 and (gaps.is_between(26, 35)).mean() > 0.7 and gaps.max() >= 54


def test_a_scraped_exporter_repeats_its_last_refresh_until_the_next():
    """dcgm-exporter scraped every tick: the values of its last refresh (every 30 s per node),
    stamped with the scrape's time; the device's memory moves in 30 s stairs."""
    leak = [{"type": "memory_leak", "at": 30, "job": "train", "ranks": [3], "leak_gib_per_step": 0.5}]
    scraped = _observe(_scenario(faults=leak, sources={"device_seconds": 30}), 180)["gpu_samples"]
    every = _observe(_scenario(faults=leak), 180)["gpu_samples"]
    assert (scraped["ts"] == scraped["delivered"]).all()
    gpu = scraped.filter((pl.col("node") == "node-000") & (pl.col("gpu") == 3)).sort("ts")
    assert gpu.height >= 150, "a row every tick once the exporter has refreshed"
    changes = gpu.filter(pl.col("memory_used_bytes").diff() != 0)
    assert 3 <= changes.height <= 6 and (changes["ts"].diff().drop_nulls() % 30 == 0).all(), changes["ts"].to_list()
    # Each value is the world's reading at the refresh: the same as the every-tick row then.
    refresh = gpu.filter(pl.col("memory_used_bytes").diff().fill_null(1) != 0).select("ts", "memory_used_bytes")
    truth = every.filter((pl.col("node") == "node-000") & (pl.col("gpu") == 3)).select("ts", pl.col("memory_used_bytes").alias("truth"))
    assert (refresh.join(truth, on="ts")["memory_used_bytes"] == refresh.join(truth, on="ts")["truth"]).all()


def test_a_late_refresh_keeps_the_old_values_longer():
    sampler = DeviceSampler(["a", "b"], 30.0, late_share=0.5, late_seconds=(10.0, 10.0), seed=2, mode="scraped")
    seen = []
    for t in range(1, 301):
        f = pl.DataFrame({"ts": [float(t)] * 2, "node": ["a", "b"], "v": [t, t]})
        out = sampler.deliver(float(t), {"gpu_samples": f})["gpu_samples"]
        seen.append(out.with_columns(pl.lit(t).alias("now")))
    rows = pl.concat(seen)
    assert (rows["ts"] == rows["now"].cast(pl.Float64)).all()
    age = rows.with_columns((pl.col("now") - pl.col("v")).alias("age"))
    # On time, a value is at most 30 s old; a late refresh lands 10 s after it was taken.
    assert age["age"].max() <= 30 + 10 and (age["age"] > 30).any() and sampler.late > 0


# -- the in-process hook ------------------------------------------------------------------------------


def test_hook_at_step_ends_at_most_once_a_second():
    rp = _observe(_scenario(sources={"hook": "step", "hook_seconds": 1.0}), 120)["rank_progress"]
    per_tick = rp.filter(pl.col("rank") == 0).sort("ts")
    # 1.2 s steps on a 1 s tick: some ticks end no step and carry no record.
    assert 60 < per_tick.height < 115, per_tick.height
    assert (per_tick["step"].diff().drop_nulls() >= 1).all(), "a record only when a step ended"
    step2 = _observe(_scenario(sources={"hook": "step", "hook_seconds": 5.0}), 120)["rank_progress"].filter(pl.col("rank") == 0)
    assert (step2["ts"].diff().drop_nulls() >= 5).all()


def test_a_hung_rank_publishes_nothing_from_step_but_does_from_a_thread():
    hang = [{"type": "nccl_hang", "at": 60, "job": "train", "ranks": [5], "mode": "outside"}]
    step = _observe(_scenario(faults=hang, sources={"hook": "step"}), 180)["rank_progress"]
    assert step.filter(pl.col("ts") > 62).height == 0, "no step ends while the job is hung"
    thread = _observe(_scenario(faults=hang, sources={"hook": "background", "hook_seconds": 10}), 180)["rank_progress"]
    late = thread.filter((pl.col("ts") > 62) & (pl.col("rank") == 0))
    assert late.height >= 10 and (late["ts"].diff().drop_nulls() == 10).all()


def test_a_hook_without_starts_marks_them_unknown_and_changes_nothing_else():
    """sources.hook_without_starts_share: the share of jobs whose hook rows carry no collective
    starts (gloo, timing off, a hook started late): null (unknown), not -1 (nothing started).
    The default is the documented use, gv.start() before the process group: starts reported.
    Chosen per job from its name, so the world and every other column stay as they were."""
    two = {"jobs": [{**FAST["jobs"][0], "gpus": 8}, {**FAST["jobs"][0], "name": "x", "gpus": 8}]}
    hang = [{"type": "nccl_hang", "at": 20, "job": "train", "ranks": [3], "mode": "inside"}]
    base = _observe(_scenario(**two, faults=hang), 40)["rank_progress"]
    assert base["last_started_seq"].null_count() == 0
    hung = base.filter((pl.col("job") == "train") & (pl.col("ts") >= 30))
    assert hung.filter(pl.col("rank") == 3)["last_started_seq"].to_list()[-1] < hung.filter(pl.col("rank") == 0)["last_started_seq"].to_list()[-1]
    none = _observe(_scenario(**two, faults=hang, sources={"hook_without_starts_share": 1.0}), 40)["rank_progress"]
    assert none["last_started_seq"].null_count() == none.height
    assert none.drop("last_started_seq").equals(base.drop("last_started_seq"))
    half = _observe(_scenario(**two, faults=hang, sources={"hook_without_starts_share": 0.5}), 40)["rank_progress"]
    unknown = half.group_by("job").agg(pl.col("last_started_seq").null_count() == pl.len())
    assert sorted(unknown.rows()) == [("train", True), ("x", False)]  # whole jobs, by name
    assert half.drop("last_started_seq").equals(base.drop("last_started_seq"))


def test_no_hook_means_no_hook_streams():
    rows = _observe(_scenario(sources={"hook": "none", "device_seconds": 30}), 120)
    assert rows["rank_progress"].height == 0 and rows["allocator_stats"].height == 0
    assert rows["gpu_samples"].height > 0


# -- logs, faults on real time scales ---------------------------------------------------------------------


def test_logs_without_job_names_leave_the_job_to_the_gpu_map():
    sc = _scenario(faults=[{"type": "gpu_lost", "at": 30, "job": "train", "ranks": [9]}], sources={"logs_name_job": False})
    ev = _observe(sc, 40)["events"]
    xid = ev.filter(pl.col("kind") == "xid")
    assert xid.height == 1 and xid["job"].to_list() == [None] and xid["node"].to_list() == ["node-001"]
    named = _observe(_scenario(faults=[{"type": "gpu_lost", "at": 30, "job": "train", "ranks": [9]}]), 40)["events"]
    assert named.filter(pl.col("kind") == "xid")["job"].to_list() == ["train"]


def test_oom_log_without_job_names_no_job_nor_rank():
    leak = [{"type": "memory_leak", "at": 20, "job": "train", "ranks": [3], "leak_gib_per_step": 3.0}]
    ev = _observe(_scenario(faults=leak, sources={"logs_name_job": False}), 90)["events"].filter(pl.col("kind") == "oom")
    assert ev.height >= 1 and ev["job"].null_count() == ev.height and ev["rank"].null_count() == ev.height
    assert ev["node"].null_count() == 0


def test_straggler_comes_and_goes():
    sc = _scenario(
        duration_seconds=1000,
        faults=[{"type": "straggler", "at": 100, "job": "train", "ranks": [11], "slowdown": 1.5, "lasts_seconds": 120, "recurs_every_seconds": 300}],
    )
    from gpuvigil.scheduler.core import Scheduler
    from gpuvigil.sim.cluster import node_specs

    sched = Scheduler(node_specs(sc))
    cluster = SimulatedCluster(sc, sched, seed=0)
    sched.cycle(0.0)
    slow_at = {}
    for t in range(1, 1001):
        cluster.observe(float(t))
        sched.cycle(float(t))
        slow_at[t] = float(cluster.jobs["train"].slowdown[11])
    assert slow_at[99] == 1.0 and slow_at[150] == 1.5 and slow_at[250] == 1.0 and slow_at[450] == 1.5 and slow_at[550] == 1.0
    assert [round(f.ts) for f in cluster.injected] == [100, 400, 700, 1000]
    assert all(f.kind == "straggler" and f.ranks == [11] for f in cluster.injected)


def test_episode_fields_are_checked():
    with pytest.raises(ValueError, match="recurs_every_seconds must be longer"):
        scenario_mod.FaultConfig.model_validate({"type": "straggler", "at": 1, "lasts_seconds": 60, "recurs_every_seconds": 60})
    with pytest.raises(ValueError, match="apply to straggler"):
        scenario_mod.FaultConfig.model_validate({"type": "memory_leak", "at": 1, "lasts_seconds": 60})
    with pytest.raises(ValueError, match="jitter_seconds must be shorter"):
        scenario_mod.SourcesConfig.model_validate({"device_seconds": 1, "jitter_seconds": 1})


def test_temperature_follows_time_not_ticks():
    """A hot GPU's temperature approaches its target with a time constant in seconds: after 60 s
    it reads about the same whether the tick is 1 s or 10 s."""
    hot = [{"type": "thermal", "at": 10, "job": "train", "ranks": [2], "temperature_c": 93}]
    temps = []
    for tick in (1.0, 10.0):
        gs = _observe(_scenario(faults=hot), 80, tick=tick)["gpu_samples"]
        temps.append(gs.filter((pl.col("ts") == 80) & (pl.col("node") == "node-000") & (pl.col("gpu") == 2))["temperature_c"].item())
    assert temps[0] > 85 and abs(temps[0] - temps[1]) < 3, temps


# -- realistic scenarios ----------------------------------------------------------------------------------


def test_realistic_scenarios_are_apart_from_the_fast_ones():
    real = scenario_mod.realistic_names()
    assert {"leak_slow_dcgm", "leak_6h_dcgm", "fragmentation_hours", "straggler_intermittent", "xid79_logs_without_job"} <= set(real)
    assert not set(real) & set(scenario_mod.builtin_names())
    for name in real:
        sc = scenario_mod.load(name)
        # Each says what its sources send: a device sample interval of a real exporter or NVML.
        assert sc.sources.device_seconds in (1.0, 15.0, 30.0, 60.0), name
        assert sc.expect is not None and sc.description
    leaks = {n: scenario_mod.load(n) for n in real if n.startswith("leak_")}
    assert min(s.duration_seconds for s in leaks.values()) >= 600 and max(s.duration_seconds for s in leaks.values()) >= 6 * 3600


def test_six_hours_at_30_s_is_720_ticks_not_six_hours():
    from gpuvigil.app.runtime import build_simulated

    rt = build_simulated("healthy_6h_dcgm")
    assert rt.tick_seconds == 30
    rt.run(rt.cluster.scenario.duration_seconds)
    assert rt.pipeline.ticks == 720 and rt.now == 21600
    gs = rt.pipeline.window.get("gpu_samples")
    assert gs.height and (_gaps(gs)["gap"] == 30).all()


def test_with_sources_and_unknown_names():
    sc = scenario_mod.with_sources(scenario_mod.load("straggler"), device_seconds=30)
    assert sc.sources.device_seconds == 30 and sc.faults == scenario_mod.load("straggler").faults
    with pytest.raises(UserError, match="--sample-interval"):
        scenario_mod.with_sources(scenario_mod.load("straggler"), device_seconds=-1)
    with pytest.raises(UserError, match="realistic: .*leak_slow_dcgm"):
        scenario_mod.load("nope")


def test_demo_sample_interval_flag():
    out = subprocess.run(
        [sys.executable, "-m", "gpuvigil", "demo", "--scenario", "xid79_logs_without_job", "--sample-interval", "30", "--json"],
        capture_output=True, text=True, timeout=300,
    )
    obj = json.loads(out.stdout.strip().splitlines()[0])
    assert obj["sampling"]["device_seconds"] == 30 and obj["sampling"]["logs_name_job"] is False
    # The kernel log named no job: the finding names it all the same, from the GPU's job map.
    xid = [f for f in obj["findings"] if f["kind"] == "xid"]
    assert any(f["job"] == "llm-pretrain" for f in xid), obj["findings"]
    bad = subprocess.run([sys.executable, "-m", "gpuvigil", "demo", "--scenario", "straggler", "--sample-interval", "0"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--sample-interval must be > 0" in bad.stderr and "Traceback" not in bad.stderr
