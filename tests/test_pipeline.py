"""The spine's mechanics: windows, finding lifecycle, hint rules and cooldown, config."""

from __future__ import annotations

import polars as pl
import pytest

from gpuvigil import config, schemas
from gpuvigil.config import ConfigError
from gpuvigil.model import Finding, FindingKind, HintAction, Severity
from gpuvigil.pipeline.core import Pipeline
from gpuvigil.pipeline.hints import HintPolicy
from gpuvigil.window import Window


def gpu_rows(ts: float, n: int = 3) -> pl.DataFrame:
    return schemas.frame([{"ts": ts, "node": "n0", "gpu": g, "memory_used_bytes": g} for g in range(n)], "gpu_samples")


def test_window_keeps_only_the_horizon_and_exposes_fresh_rows():
    w = Window({"default": 10.0})
    for t in range(0, 30):
        w.add("gpu_samples", gpu_rows(float(t)))
        w.seal(float(t))
    df = w.get("gpu_samples")
    assert df["ts"].min() == 19.0 and df["ts"].max() == 29.0
    assert w.fresh("gpu_samples")["ts"].unique().to_list() == [29.0]
    assert w.rows_ingested["gpu_samples"] == 90


def test_window_snapshot_streams_replace_instead_of_append():
    w = Window(60.0)
    w.add("nodes", schemas.frame([{"node": "a", "state": "up"}], "nodes"))
    w.add("nodes", schemas.frame([{"node": "a", "state": "cordoned"}], "nodes"))
    w.seal(1.0)
    assert w.get("nodes")["state"].to_list() == ["cordoned"]


def test_window_of_unknown_stream_is_empty_with_schema():
    w = Window(60.0)
    assert w.get("rank_progress").schema == schemas.RANK_PROGRESS


def test_conform_adds_missing_columns_and_rejects_bad_types():
    df = pl.DataFrame({"ts": [1.0], "node": ["a"], "gpu": [0], "extra": [1]})
    out = schemas.conform(df, "gpu_samples")
    assert out.columns == list(schemas.GPU_SAMPLES)
    assert out["memory_used_bytes"].to_list() == [None]
    with pytest.raises(schemas.SchemaError):
        schemas.conform(pl.DataFrame({"ts": ["yesterday"]}), "gpu_samples")
    with pytest.raises(schemas.SchemaError, match="ts"):
        schemas.conform(pl.DataFrame({"node": ["a"]}), "gpu_samples")


class ScriptedDetector:
    """Reports the findings scripted for each tick."""

    name = "scripted"

    def __init__(self, script: dict[float, list[Finding]]):
        self.script = script

    def detect(self, window):
        return list(self.script.get(window.now, []))


def hang(ts: float, node: str = "node-1") -> Finding:
    return Finding(kind=FindingKind.COLLECTIVE_HANG, severity=Severity.PAGE, ts=ts, job="j", ranks=[3], culprit_ranks=[3], node=node, gpu=3, cause="hardware", summary="j hung", source="scripted")


def test_finding_lifecycle_new_active_cleared_and_hints_expire():
    script = {t: [hang(t)] for t in (1.0, 2.0, 3.0)}
    cfg = config.load(overrides={"pipeline": {"clear_after_seconds": {"default": 5.0}, "detector_every_seconds": {"default": 0}}})
    p = Pipeline([], [ScriptedDetector(script)], cfg=cfg)
    r1 = p.tick(1.0)
    assert [f.kind for f in r1.new_findings] == [FindingKind.COLLECTIVE_HANG]
    # hardware hang → cordon the node and requeue the job excluding it (hints.yaml)
    assert [h.action for h in r1.new_hints] == [HintAction.CORDON_NODE, HintAction.REQUEUE_JOB]
    assert r1.new_hints[1].exclude_nodes == ["node-1"]
    r2 = p.tick(2.0)
    assert r2.new_findings == [] and len(r2.active_findings) == 1, "a repeated cause is one finding"
    p.tick(3.0)
    assert p.tick(8.0).cleared_findings == []
    r = p.tick(9.0)
    assert [f.kind for f in r.cleared_findings] == [FindingKind.COLLECTIVE_HANG]
    assert {h.action for h in r.expired_hints} == {HintAction.CORDON_NODE, HintAction.REQUEUE_JOB}


def test_same_hint_is_not_reissued_within_cooldown():
    script = {1.0: [hang(1.0)], 50.0: [hang(50.0)]}
    cfg = config.load(overrides={"pipeline": {"clear_after_seconds": {"default": 5.0}, "hint_cooldown_seconds": 3600}})
    p = Pipeline([], [ScriptedDetector(script)], cfg=cfg)
    assert len(p.tick(1.0).new_hints) == 2
    assert len(p.tick(10.0).cleared_findings) == 1, "a tick without it, past its clear time: cleared"
    r = p.tick(50.0)
    assert len(r.new_findings) == 1, "the cause came back: a new finding (and a new page)"
    assert r.new_hints == [], "but the remedy that did not work is not repeated"


def test_what_the_pipeline_remembers_of_causes_stays_bounded():
    """A thousand causes, each seen once and cleared: nothing of a cleared finding is kept, and a
    hint's issue time is kept only while its cooldown can still hold it back."""
    script = {float(t): [hang(float(t), node=f"node-{t}").model_copy(update={"job": f"j{t}"})] for t in range(1000)}
    cfg = config.load(overrides={"pipeline": {"clear_after_seconds": {"default": 5.0}, "hint_cooldown_seconds": 100}})
    p = Pipeline([], [ScriptedDetector(script)], cfg=cfg)
    for t in range(1000):
        p.tick(float(t))
    assert len(p.active) <= 7
    assert len(p.first_seen) == len(p.last_seen) == len(p.active)
    assert len(p._hint_issued_at) <= 2 * 101  # two hints per cause, causes of the last 100 s
    # a cause of 50 s ago comes back: a new finding, but its remedy is still cooling down
    script[1000.0] = [script[950.0][0].model_copy(update={"ts": 1000.0})]
    again = p.tick(1000.0)
    assert len(again.new_findings) == 1 and again.new_hints == []


@pytest.mark.parametrize("tick_seconds", [1.0, 30.0, 60.0, 600.0])
def test_a_cause_reported_on_every_tick_is_one_finding_however_long_the_ticks(tick_seconds):
    """A replay of 15-60 s Prometheus history ticks at the data's step, longer than the 30 s clear
    time: a prediction repeated on every tick is one finding and one set of hints, not a new page
    each tick. A tick without it, past its clear time, still clears it."""
    ticks = [1000.0 + i * tick_seconds for i in range(6)]
    script = {t: [hang(t)] for t in ticks}
    cfg = config.load(overrides={"pipeline": {"clear_after_seconds": {"default": 30.0}, "detector_every_seconds": {"default": 0}}})
    p = Pipeline([], [ScriptedDetector(script)], cfg=cfg)
    results = [p.tick(t) for t in ticks]
    assert [len(r.new_findings) for r in results] == [1, 0, 0, 0, 0, 0]
    assert sum(len(r.new_hints) for r in results) == 2
    assert all(r.cleared_findings == [] for r in results)
    quiet = p.tick(ticks[-1] + max(tick_seconds, 31.0))
    assert [f.kind for f in quiet.cleared_findings] == [FindingKind.COLLECTIVE_HANG]


def test_a_ticket_that_becomes_a_page_is_reported_as_escalated_once():
    def predicted(ts: float, severity: Severity) -> Finding:
        return Finding(kind=FindingKind.OOM_PREDICTED, severity=severity, ts=ts, job="j", summary="j will run out of memory", source="scripted", cause="leak")

    script = {1.0: [predicted(1.0, Severity.TICKET)], 2.0: [predicted(2.0, Severity.TICKET)], 3.0: [predicted(3.0, Severity.PAGE)], 4.0: [predicted(4.0, Severity.PAGE)]}
    p = Pipeline([], [ScriptedDetector(script)], cfg=config.load(overrides={"pipeline": {"detector_every_seconds": {"default": 0}}}))
    results = [p.tick(t) for t in (1.0, 2.0, 3.0, 4.0)]
    assert [len(r.new_findings) for r in results] == [1, 0, 0, 0], "one cause, one finding"
    assert [[f.severity for f in r.escalated_findings] for r in results] == [[], [], [Severity.PAGE], []]
    assert results[2].escalated_findings[0].id == results[0].new_findings[0].id


def test_detector_period_keeps_its_findings_alive_between_runs():
    calls = []

    class Periodic:
        name = "oom"

        def detect(self, window):
            calls.append(window.now)
            return [Finding(kind=FindingKind.OOM_PREDICTED, severity=Severity.PAGE, ts=window.now, job="j", summary="s", source="oom")]

    cfg = config.load(overrides={"pipeline": {"detector_every_seconds": {"oom": 5}, "clear_after_seconds": {"default": 2}}})
    p = Pipeline([], [Periodic()], cfg=cfg)
    for t in range(1, 12):
        r = p.tick(float(t))
        assert len(r.active_findings) == 1
    assert calls == [1.0, 6.0, 11.0]


HINT_TABLE = [
    # kind, cause, evidence, expected actions
    (FindingKind.XID, "hardware", {"fatal": True}, [HintAction.CORDON_NODE, HintAction.REQUEUE_JOB]),
    (FindingKind.XID, "software", {"fatal": False}, []),
    (FindingKind.COLLECTIVE_HANG, "software", {}, [HintAction.REQUEUE_JOB]),
    (FindingKind.ECC, "hardware", {}, [HintAction.DRAIN_NODE, HintAction.REQUEUE_JOB]),
    (FindingKind.OOM_PREDICTED, "fragmentation", {}, [HintAction.SET_ALLOC_CONF]),
    (FindingKind.OOM_PREDICTED, "leak", {}, [HintAction.RESIZE_OR_MOVE_JOB]),
    (FindingKind.FRAGMENTATION_CLUSTER, None, {"moves": [{"job": "a", "from_node": "n1", "to_node": "n2"}]}, [HintAction.COMPACT]),
    (FindingKind.STRAGGLER, None, {}, [HintAction.AVOID_GPU]),
    (FindingKind.ANOMALY, None, {}, []),
]


@pytest.mark.parametrize("kind,cause,evidence,actions", HINT_TABLE)
def test_hint_rules(kind, cause, evidence, actions):
    f = Finding(kind=kind, severity=Severity.PAGE, ts=1.0, job="j", node="n1", gpu=2, cause=cause, evidence=evidence, summary="s")
    hints = HintPolicy().hints_for(f)
    assert [h.action for h in hints] == actions
    for h in hints:
        assert h.finding_id == f.id and h.reason.startswith(kind.value)
    if HintAction.SET_ALLOC_CONF in actions:
        assert hints[0].params["alloc_conf"] == "expandable_segments:True"
    if HintAction.COMPACT in actions:
        assert hints[0].params["moves"][0]["to_node"] == "n2"


def test_finding_and_hint_json_round_trip():
    f = hang(1.0)
    d = f.to_json_dict()
    assert d["id"] == f.id and d["kind"] == "collective_hang"
    assert Finding.model_validate({k: v for k, v in d.items() if k != "id"}) == f
    frame = __import__("gpuvigil.model", fromlist=["findings_frame"]).findings_frame([f])
    assert frame.schema == schemas.FINDINGS


def test_user_config_overrides_and_rejects_bad_values(tmp_path):
    good = tmp_path / "c.yaml"
    good.write_text("pipeline:\n  tick_seconds: 2.5\n")
    cfg = config.load(good)
    assert cfg["pipeline"]["tick_seconds"] == 2.5
    assert cfg["pipeline"]["horizon_seconds"]["gpu_samples"] > 0, "deep merge keeps other defaults"
    bad = tmp_path / "bad.yaml"
    bad.write_text("pipeline:\n  tick_seconds: -1\n")
    with pytest.raises(ConfigError, match="tick_seconds"):
        Pipeline([], [], cfg=config.load(bad))
    unknown = tmp_path / "u.yaml"
    unknown.write_text("nonsense: {}\n")
    with pytest.raises(ConfigError, match="unknown config section"):
        config.load(unknown)
