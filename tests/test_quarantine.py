"""The quarantine state machine and the circuit breaker (gpuvigil/scheduler/quarantine.py) on their own:
moves only by rule, each recorded; state and breaker survive a reopen of the file; the breaker's
limits, its one page, and closing by a person."""

from __future__ import annotations

import pytest

from gpuvigil import config
from gpuvigil.scheduler.quarantine import (
    ActingConfig,
    Breaker,
    BreakerConfig,
    HoldDown,
    IllegalTransition,
    QuarantineMachine,
    QuarantineStore,
    State,
    StepResult,
    acting_config,
    store_beside,
)


def test_yaml_and_model_defaults_agree():
    assert acting_config(config.defaults()) == ActingConfig()


def test_a_record_moves_by_rule_and_every_move_is_recorded(tmp_path):
    path = tmp_path / "q.db"
    with QuarantineStore(path) as store:
        m = QuarantineMachine(store)
        rec = m.get("n1")
        assert rec.state == State.HEALTHY
        m.add_cause(rec, finding_id="f1", kind="xid", summary="XID 79 on n1 GPU 3", hint_id="h1")
        m.transition(rec, State.SUSPECT, now=10.0, rule="finding", cause="xid f1", finding_ids=["f1"], evidence={"xid": 79})
        with pytest.raises(IllegalTransition):
            m.transition(rec, State.VERIFYING, now=11.0, rule="nonsense")
        rec.action = "drain_node"
        m.transition(rec, State.DRAINING, now=12.0, rule="applied", cause="drained", finding_ids=["f1"])
        # An operator may only hold, RMA or release.
        with pytest.raises(IllegalTransition):
            m.transition(rec, State.CORDONED, now=13.0, rule="x", who="operator:ann")
    # A new process reads the same state back.
    with QuarantineStore(path) as store:
        m = QuarantineMachine(store)
        rec = m.get("n1")
        assert (rec.state, rec.action, rec.since) == (State.DRAINING, "drain_node", 12.0)
        assert rec.causes["f1"].hint_ids == ["h1"]
        hist = m.history("n1")
        assert [(t.from_state, t.to_state, t.who, t.rule) for t in hist] == [("healthy", "suspect", "rule", "finding"), ("suspect", "draining", "rule", "applied")]
        assert hist[0].evidence == {"xid": 79} and hist[0].finding_ids == ["f1"]
        assert "healthy -> suspect by rule (finding): xid f1 [f1]" in hist[0].line()
        assert m.why("n1")["records"][0]["state"] == "draining"


def test_hold_down_then_verify_then_healthy_and_a_returning_cause_goes_back(tmp_path):
    with QuarantineStore(":memory:") as store:
        m = QuarantineMachine(store)
        steps = HoldDown(600)
        rec = m.get("n1")
        m.add_cause(rec, finding_id="f1", kind="pcie", summary="replays")
        rec.action = "cordon_node"
        m.transition(rec, State.CORDONED, now=0.0, rule="applied")
        assert m.advance(rec, steps, 10.0) is None  # still active
        m.observe(set(), {"f1"}, 30.0)  # its hint expired: quiet from t=30
        rec = m.get("n1")
        assert m.advance(rec, steps, 31.0).to_state == "remediating"
        assert m.advance(rec, steps, 60.0) is None  # quiet for 30 s of 600
        # The cause is reported again: back to cordoned, the hold-down starts over later.
        m.observe({"f1"}, set(), 90.0)
        rec = m.get("n1")
        assert m.advance(rec, steps, 91.0).to_state == "cordoned"
        m.observe(set(), {"f1"}, 100.0)
        rec = m.get("n1")
        m.advance(rec, steps, 101.0)
        assert m.advance(rec, steps, 699.0) is None
        assert m.advance(rec, steps, 701.0).to_state == "verifying"
        assert m.advance(rec, steps, 702.0) is None and m.verified(rec)
        m.transition(rec, State.HEALTHY, now=703.0, rule="returned")
        assert m.get("n1").causes == {} and m.get("n1").action is None


class FailingCheck(HoldDown):
    def __init__(self):
        super().__init__(0)
        self.calls = 0

    def verify(self, record, now):
        self.calls += 1
        return StepResult("failed", "nvidia-smi -q failed") if self.calls == 1 else StepResult("rma", "failed twice")


def test_a_failing_check_goes_back_to_remediation_and_then_to_rma():
    with QuarantineStore(":memory:") as store:
        m = QuarantineMachine(store)
        rec = m.get("n2", 3)
        assert rec.key == "n2/3"
        m.add_cause(rec, finding_id="f", kind="ecc", summary="dbe")
        rec.action = "avoid_gpu"
        m.transition(rec, State.CORDONED, now=0, rule="applied")
        m.observe(set(), {"f"}, 1)
        steps = FailingCheck()
        rec = m.get("n2", 3)
        got = [m.advance(rec, steps, t) for t in (2, 3, 4, 5, 6)]
        assert [g.to_state for g in got if g] == ["remediating", "verifying", "remediating", "verifying", "rma"]
        with pytest.raises(IllegalTransition):
            m.transition(rec, State.HEALTHY, now=7, rule="returned")  # only a person returns an RMA
        m.transition(rec, State.HEALTHY, now=8, rule="repaired", who="operator:bob")
        assert m.history("n2")[-1].who == "operator:bob"


def test_breaker_limits_trip_page_once_and_stay_open_until_closed(tmp_path):
    path = tmp_path / "q.db"
    cfg = BreakerConfig(window_seconds=300, max_node_fraction=0.5, max_gpu_fraction=1.0, max_nodes=3)
    with QuarantineStore(path) as store:
        b = Breaker(store, cfg)
        assert b.limits(10, 80) == (3, 80)  # the absolute cap is below 50% of 10
        assert b.limits(4, 32) == (2, 32)
        admitted = [b.admit(f"n{i}", nodes=1, gpus=8, fleet_nodes=4, fleet_gpus=32, now=100 + i, cause="xid") for i in range(4)]
        assert admitted == [True, True, False, False]
        assert b.is_open
        text = b.page_due()
        assert text.startswith("breaker open: 2 node(s) would have been drained (16 GPU(s)), top causes xid (2)")
        assert b.page_due() is None
        # Asking again for a node already counted does not count it twice.
        assert not b.admit("n3", nodes=1, gpus=8, fleet_nodes=4, fleet_gpus=32, now=200, cause="xid")
        assert b.state().would_have_nodes == 2
    with QuarantineStore(path) as store:  # a restart: still open, not paged again
        b = Breaker(store, cfg)
        assert b.is_open and b.page_due() is None
        # Long after the window, still open: only a person closes it.
        assert not b.admit("n9", nodes=1, gpus=8, fleet_nodes=4, fleet_gpus=32, now=10_000, cause="ecc")
        b.close(who="operator:ann", now=10_001, note="driver rolled back")
        assert not b.is_open
        assert b.admit("n9", nodes=1, gpus=8, fleet_nodes=4, fleet_gpus=32, now=10_002, cause="ecc")
        st = b.status(10_003)
        assert (st["trips"], st["closed_by"], st["taken_in_window"]["nodes"]) == (1, "operator:ann", 1)
        assert [e["event"] for e in st["log"]] == ["open", "close"]
        names = {f.name for f in b.families()}
        assert {"gpuvigil_breaker_open", "gpuvigil_breaker_trips"} <= names


def test_breaker_gpu_limit_and_sliding_window():
    cfg = BreakerConfig(window_seconds=60, max_node_fraction=1.0, max_gpu_fraction=0.25, max_nodes=100)
    with QuarantineStore(":memory:") as store:
        b = Breaker(store, cfg)
        # 4 nodes x 8 GPUs: 8 GPUs may go. One whole node alone may always go.
        assert b.admit("a", nodes=1, gpus=8, fleet_nodes=4, fleet_gpus=32, now=0, cause="ecc")
        # After the window, the first is forgotten.
        assert b.admit("b", nodes=1, gpus=8, fleet_nodes=4, fleet_gpus=32, now=61, cause="ecc")
        assert not b.admit("c/1", nodes=0, gpus=1, fleet_nodes=4, fleet_gpus=32, now=62, cause="xid")
        assert b.is_open


def test_disabled_breaker_admits_everything_and_store_beside(tmp_path):
    with QuarantineStore(":memory:") as store:
        b = Breaker(store, BreakerConfig(enabled=False))
        assert all(b.admit(f"n{i}", nodes=1, gpus=8, fleet_nodes=2, fleet_gpus=16, now=i, cause="x") for i in range(5))
    s = store_beside(tmp_path / "hints.db")
    assert s.path.endswith("hints.quarantine.db")
    s.close()


def test_breaker_and_node_records_over_the_api_need_the_token(tmp_path):
    from fastapi.testclient import TestClient

    from gpuvigil.api.app import create_app
    from gpuvigil.api.store import HintStore

    token = "t" * 32
    with HintStore(tmp_path / "hints.db") as hints, store_beside(tmp_path / "hints.db") as store:
        b = Breaker(store, BreakerConfig(max_node_fraction=0.5), scope="slurm")
        assert b.admit("n1", nodes=1, gpus=8, fleet_nodes=2, fleet_gpus=16, now=1, cause="xid")
        assert not b.admit("n2", nodes=1, gpus=8, fleet_nodes=2, fleet_gpus=16, now=2, cause="xid")
        m = QuarantineMachine(store)
        rec = m.get("n1")
        m.transition(rec, State.SUSPECT, now=1, rule="finding", cause="xid", finding_ids=["f1"])
        with TestClient(create_app(hints, token)) as c:
            auth = {"Authorization": f"Bearer {token}"}
            assert c.get("/v1/breaker").status_code == 401
            assert c.post("/v1/breaker/close", json={"who": "ann"}).status_code == 401
            [st] = c.get("/v1/breaker", headers=auth).json()["breakers"]
            assert (st["scope"], st["open"], st["would_have_nodes"]) == ("slurm", True, 1)
            assert c.post("/v1/breaker/close", headers=auth, json={"who": ""}).status_code == 422
            closed = c.post("/v1/breaker/close", headers=auth, json={"who": "ann", "note": "rollback"}).json()["closed"]
            assert [x["closed_by"] for x in closed] == ["operator:ann"]
            assert not b.is_open  # the acting loop's own view of the file
            why = c.get("/v1/nodes/n1/quarantine", headers=auth).json()
            assert why["records"][0]["state"] == "suspect" and why["history"][0]["finding_ids"] == ["f1"]
            assert c.get("/v1/nodes/n9/quarantine", headers=auth).status_code == 404


def test_the_built_in_schedulers_health_plugin_stops_at_the_breaker():
    from gpuvigil.model import FindingKind, Hint, HintAction
    from gpuvigil.scheduler.core import Scheduler
    from gpuvigil.scheduler.state import NodeSpec

    cfg = config.load(overrides={"acting": {"breaker": {"max_node_fraction": 0.5, "max_gpu_fraction": 0.5}}})
    sched = Scheduler([NodeSpec(f"n{i}") for i in range(4)], cfg)
    cordon = [Hint(action=HintAction.CORDON_NODE, ts=0, reason="xid 79", finding_id=f"{i:016x}", finding_kind=FindingKind.XID, node=f"n{i}") for i in range(4)]
    done = [a.action for h in cordon[:3] for a in sched.apply_hint(h, 10.0 + int(h.node[1:]))]
    assert done == ["cordoned", "cordoned", "breaker_open", "breaker_held"]
    assert [n for n, ns in sched.nodes.items() if ns.state != "up"] == ["n0", "n1"]
    health = sched.plugin("health")
    health.close_breaker("ann", 20.0)
    assert [a.action for a in sched.apply_hint(cordon[3], 21.0)] == ["cordoned"]
    # A SchedulerConfig alone keeps the breaker's defaults (25% of 4 nodes: one).
    from gpuvigil.scheduler.config import SchedulerConfig

    plain = Scheduler([NodeSpec(f"n{i}") for i in range(4)], SchedulerConfig())
    assert [a.action for h in cordon[:2] for a in plain.apply_hint(h, 1.0)] == ["cordoned", "breaker_open", "breaker_held"]


def test_acting_metrics_are_lint_clean(tmp_path):
    import subprocess

    from gpuvigil.app.acting import Acting
    from gpuvigil.exporter.prometheus import _render
    from gpuvigil.scheduler.slurm import SlurmAdapter
    from services import PROMTOOL, binary

    acting = Acting("slurm", "on", store=None, adapter=SlurmAdapter(), quarantine=store_beside(tmp_path / "h.db"))
    acting.breaker.admit("n1", nodes=1, gpus=8, fleet_nodes=1, fleet_gpus=8, now=1.0, cause="xid")
    text = _render(acting.families()).decode()
    assert 'gpuvigil_breaker_open{scope="slurm"} 0.0' in text and 'gpuvigil_quarantine_records{scheduler="slurm",state="healthy"} 0.0' in text
    proc = subprocess.run([binary(PROMTOOL), "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "" and proc.stderr.strip() == "", proc.stdout + proc.stderr


def test_a_person_holds_and_releases_a_node(tmp_path, capsys):
    from gpuvigil.cli.main import main

    db = tmp_path / "hints.db"
    assert main(["quarantine", "hold", "n1", "--hint-db", str(db)]) == 2  # nothing acted yet: no file
    with store_beside(db) as store:
        m = QuarantineMachine(store)
        rec = m.get("n1")
        m.add_cause(rec, finding_id="f1", kind="xid", summary="XID 79")
        m.transition(rec, State.SUSPECT, now=1, rule="finding", cause="xid", finding_ids=["f1"])
    capsys.readouterr()
    assert main(["quarantine", "release", "n1", "--hint-db", str(db)]) == 2
    assert "n1 is suspect: only an operator_held or rma record is released" in capsys.readouterr().err
    assert main(["quarantine", "hold", "n1", "--hint-db", str(db), "--who", "ann", "--note", "reseating GPUs"]) == 0
    assert "suspect -> operator_held by operator:ann (operator_hold): reseating GPUs [f1]" in capsys.readouterr().out
    assert main(["quarantine", "release", "n1", "--hint-db", str(db), "--who", "ann"]) == 0
    with store_beside(db) as store:
        m = QuarantineMachine(store)
        assert m.get("n1").state == State.HEALTHY
        assert [(t.to_state, t.who) for t in m.history("n1")] == [("suspect", "rule"), ("operator_held", "operator:ann"), ("healthy", "operator:ann")]
