"""The hint/finding store: WAL persistence across restarts and processes, dedup by cause,
expiry when the cause clears, the ack/nack state machine, filters, thread safety.

Findings come through the real Pipeline (lifecycle + hint rules from hints.yaml) with a scripted
detector, so the store sees exactly what a running pipeline would hand its sinks.
"""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import threading

import pytest

from gpuvigil.api.store import BlankReason, HintNotFound, HintState, HintStateConflict, HintStore
from gpuvigil.errors import UserError
from gpuvigil.model import HintAction
from h_api_helpers import ecc_finding, hang_finding, pipeline_into, straggler_finding


@pytest.fixture
def db(tmp_path):
    return tmp_path / "hints.db"


def test_store_is_wal_and_pipeline_findings_become_pending_hints(db):
    with HintStore(db) as store:
        assert store.journal_mode == "wal"
        pipe = pipeline_into(store, [[ecc_finding()]])
        pipe.tick(100.0)
        hints = store.hints()
        # hints.yaml: ecc → drain_node + requeue_job; requeue needs a job, the ECC finding has none.
        assert [h.action for h in hints] == [HintAction.DRAIN_NODE]
        h = hints[0]
        assert (h.state, h.node, h.occurrences, h.first_seen, h.finding_kind.value) == (HintState.PENDING, "node-a", 1, 100.0, "ecc")
        assert h.id == pipe.all_hints[0].id
        assert h.to_hint() == pipe.all_hints[0]
        [f] = store.findings()
        assert (f.active, f.kind.value, f.node, f.gpu, f.severity.value) == (True, "ecc", "node-a", 3, "page")


def test_cause_seen_every_tick_is_one_finding_and_one_hint_per_action(db):
    with HintStore(db) as store:
        pipe = pipeline_into(store, [[hang_finding()]] * 5)
        for t in range(5):
            pipe.tick(100.0 + t)
        hints = store.hints()
        assert sorted(h.action.value for h in hints) == ["cordon_node", "requeue_job"]
        [f] = store.findings()
        assert (f.first_seen, f.last_seen, f.occurrences) == (100.0, 104.0, 1)
        requeue = next(h for h in hints if h.action == HintAction.REQUEUE_JOB)
        assert requeue.exclude_nodes == ["node-b"]


def test_duplicate_hint_for_same_cause_is_merged_not_inserted(db):
    with HintStore(db) as store:
        pipe = pipeline_into(store, [[hang_finding()]])
        pipe.tick(100.0)
        original = {h.id: h for h in store.hints()}
        # Another producer (or a restarted pipeline) hands the same hints again, later.
        store.record(now=250.0, new_hints=[h.to_hint().model_copy(update={"ts": 250.0}) for h in original.values()])
        merged = {h.id: h for h in store.hints()}
        assert merged.keys() == original.keys()
        for hid, h in merged.items():
            assert (h.first_seen, h.last_seen, h.occurrences, h.state) == (100.0, 250.0, 2, HintState.PENDING)
            assert h.seq > original[hid].seq
        assert sqlite3.connect(db).execute("SELECT COUNT(*) FROM hints").fetchone()[0] == 2


def test_hint_expires_when_its_cause_clears_and_reopens_when_it_returns(db):
    with HintStore(db, wall_clock=lambda: 5000.0) as store:
        script = [[ecc_finding()]] * 3 + [[]] * 4 + [[ecc_finding()]]
        # No cooldown: the pipeline issues the hint again when the cause returns.
        pipe = pipeline_into(store, script, clear_after=20.0, hint_cooldown=0.0)
        times = [100, 110, 120, 130, 140, 150, 160, 170]
        for t in times[:3]:
            pipe.tick(float(t))
        [h] = store.hints()
        assert h.state == HintState.PENDING
        pipe.tick(130.0)
        pipe.tick(140.0)  # 20 s since last report: not yet cleared (needs more than clear_after)
        assert store.get_hint(h.id).state == HintState.PENDING
        pipe.tick(150.0)
        expired = store.get_hint(h.id)
        assert expired.state == HintState.EXPIRED
        # The pipeline clock says when the cause cleared; the state change is stamped by the wall clock.
        assert expired.state_wall == 5000.0
        assert expired.state_reason.startswith(f"cause cleared: ecc finding {h.finding_id}")
        [f] = store.findings()
        assert (f.active, f.cleared_ts) == (False, 150.0)
        pipe.tick(160.0)
        pipe.tick(170.0)  # the cause is back
        back = store.get_hint(h.id)
        assert (back.state, back.occurrences, back.first_seen, back.last_seen) == (HintState.PENDING, 2, 100.0, 170.0)
        [f] = store.findings()
        assert (f.active, f.cleared_ts, f.occurrences) == (True, None, 2)
        assert [e["event"] for e in store.hint_history(h.id)] == ["new", "expired", "reopened"]


def test_cause_returning_within_the_hint_cooldown_keeps_the_hint_expired(db):
    # The pipeline does not repeat a remedy within hint_cooldown_seconds (it escalates to people
    # instead); the store shows the finding active again and the hint still expired.
    with HintStore(db) as store:
        pipe = pipeline_into(store, [[ecc_finding()], [], [ecc_finding()]], clear_after=5.0)
        for t in (100.0, 110.0, 120.0):
            pipe.tick(t)
        [h] = store.hints()
        assert (h.state, h.occurrences) == (HintState.EXPIRED, 1)
        [f] = store.findings()
        assert (f.active, f.occurrences, f.cleared_ts) == (True, 2, None)


def test_cause_clearing_and_returning_in_one_tick_stays_active(db):
    with HintStore(db) as store:
        pipe = pipeline_into(store, [[hang_finding()], [], [hang_finding()]], clear_after=5.0, hint_cooldown=0.0)
        pipe.tick(100.0)
        pipe.tick(103.0)  # missed, but quiet for less than 5 s: still active
        pipe.tick(110.0)  # cleared (quiet > 5 s since a tick without it) and reported again in the same tick
        [f] = store.findings()
        assert (f.active, f.occurrences, f.last_seen) == (True, 2, 110.0)
        assert {h.state for h in store.hints()} == {HintState.PENDING}
        assert {h.occurrences for h in store.hints()} == {2}


def test_acked_hint_also_expires_so_the_scheduler_may_undo(db):
    with HintStore(db) as store:
        pipe = pipeline_into(store, [[ecc_finding()]], clear_after=10.0)
        pipe.tick(100.0)
        [h] = store.hints()
        store.ack(h.id, "drained node-a", now=101.0)
        pipe.tick(120.0)
        assert store.get_hint(h.id).state == HintState.EXPIRED


# (steps before, operation, expected state or exception)
STATE_MACHINE = [
    ([], ("ack", "drained"), HintState.ACKED),
    ([], ("nack", "node hosts a P0 job"), HintState.NACKED),
    ([("ack", None)], ("ack", None), HintState.ACKED),  # idempotent retry
    ([("nack", "busy")], ("nack", "busy"), HintState.NACKED),  # idempotent retry
    ([("ack", None)], ("nack", "changed my mind"), HintStateConflict),
    ([("nack", "busy")], ("ack", None), HintStateConflict),
    ([("nack", "busy")], ("nack", "other reason"), HintStateConflict),
    ([("expire", None)], ("ack", None), HintStateConflict),
    ([("expire", None)], ("nack", "late"), HintStateConflict),
    ([], ("nack", "   "), BlankReason),
]


@pytest.mark.parametrize("before,op,expected", STATE_MACHINE)
def test_ack_nack_state_machine(db, before, op, expected):
    with HintStore(db) as store:
        finding = ecc_finding()
        pipe = pipeline_into(store, [[finding]], clear_after=1.0)
        pipe.tick(100.0)
        [h] = store.hints()
        for name, arg in before:
            if name == "expire":
                pipe.tick(200.0)
            else:
                getattr(store, name)(h.id, arg)
        seq_before = store.get_hint(h.id).seq
        name, arg = op
        if isinstance(expected, type) and issubclass(expected, Exception):
            with pytest.raises(expected):
                getattr(store, name)(h.id, arg)
            assert store.get_hint(h.id).seq == seq_before  # a refused transition changes nothing
        else:
            rec = getattr(store, name)(h.id, arg)
            assert rec.state == expected
            if name == "nack":
                assert rec.state_reason == arg.strip()


def test_unknown_hint_raises_not_found(db):
    with HintStore(db) as store, pytest.raises(HintNotFound):
        store.ack("0123456789abcdef")


def test_failed_apply_attempt_keeps_hint_pending_with_the_error(db):
    with HintStore(db) as store:
        pipeline_into(store, [[ecc_finding()]]).tick(100.0)
        [h] = store.hints()
        rec = store.record_attempt(h.id, "scontrol: Unable to contact slurm controller")
        assert (rec.state, rec.attempts, rec.last_error) == (HintState.PENDING, 1, "scontrol: Unable to contact slurm controller")
        assert [x.id for x in store.pending_hints()] == [h.id]
        rec = store.record_attempt(h.id, None)
        assert (rec.state, rec.attempts, rec.last_error) == (HintState.PENDING, 2, None)


def test_restart_loses_nothing(db):
    store = HintStore(db)
    pipe = pipeline_into(store, [[ecc_finding(), hang_finding(), straggler_finding()]], clear_after=1000.0)
    pipe.tick(100.0)
    hints = store.hints()
    store.ack(hints[0].id, "done", now=101.0)
    store.nack(hints[1].id, "P0 job on that node", now=102.0)
    store.record_attempt(hints[2].id, "timeout", now=103.0)
    before_hints = [h.model_dump() for h in store.hints()]
    before_findings = [f.model_dump() for f in store.findings()]
    before_log = {h["id"]: store.hint_history(h["id"]) for h in before_hints}
    store.close()

    reopened = HintStore(db)
    assert [h.model_dump() for h in reopened.hints()] == before_hints
    assert [f.model_dump() for f in reopened.findings()] == before_findings
    assert {h["id"]: reopened.hint_history(h["id"]) for h in before_hints} == before_log
    # A fresh pipeline after the restart reports the same causes again: merged, states kept.
    pipe2 = pipeline_into(reopened, [[ecc_finding(), hang_finding(), straggler_finding()]], clear_after=1000.0)
    pipe2.tick(300.0)
    after = {h.id: h for h in reopened.hints()}
    assert len(after) == len(before_hints)
    for old in before_hints:
        assert after[old["id"]].state == old["state"]
        assert after[old["id"]].occurrences == old["occurrences"] + 1
    reopened.close()


def test_cause_clearing_after_restart_expires_hints_the_new_pipeline_never_issued(db):
    with HintStore(db) as store:
        pipeline_into(store, [[hang_finding()]]).tick(100.0)
    with HintStore(db) as store:
        # The restarted pipeline sees the finding once more, then it clears.
        pipe = pipeline_into(store, [[hang_finding()]], clear_after=5.0)
        pipe.tick(200.0)
        pipe.tick(210.0)
        assert {h.state for h in store.hints()} == {HintState.EXPIRED}


def test_another_process_sees_and_changes_the_same_store(db):
    with HintStore(db) as store:
        pipeline_into(store, [[ecc_finding()]]).tick(100.0)
        [h] = store.hints()
        code = (
            "import sys; from gpuvigil.api.store import HintStore\n"
            "s = HintStore(sys.argv[1]); r = s.nack(sys.argv[2], 'maintenance window'); print(r.state.value); s.close()"
        )
        out = subprocess.run([sys.executable, "-c", code, str(db), h.id], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == "nacked"
        rec = store.get_hint(h.id)
        assert (rec.state, rec.state_reason) == (HintState.NACKED, "maintenance window")


def test_readers_and_a_writer_share_one_store_across_threads(db):
    store = HintStore(db)
    errors: list[BaseException] = []
    nodes = [f"node-{i:02d}" for i in range(40)]
    script = [[ecc_finding(node=n, gpu=0)] for n in nodes]
    pipe = pipeline_into(store, script, clear_after=1e9)
    done = threading.Event()

    def write():
        try:
            for t in range(len(script)):
                pipe.tick(100.0 + t)
        except BaseException as exc:  # noqa: BLE001 - surfaced below
            errors.append(exc)
        finally:
            done.set()

    def read():
        try:
            while not done.is_set():
                hints = store.hints()
                assert all(h.state == HintState.PENDING for h in hints)
                store.findings(active=True)
                store.changes_after(0)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=write)] + [threading.Thread(target=read) for _ in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not errors, errors
    assert len(store.hints()) == len(nodes)
    assert store.counts() == {"hints_pending": 40, "findings_active": 40, "findings_total": 40}
    store.close()


FILTERS = [
    ({"node": "node-a"}, {"drain_node"}),
    ({"job": "job-7"}, {"cordon_node", "requeue_job"}),
    ({"action": "avoid_gpu"}, {"avoid_gpu"}),
    ({"state": "acked"}, {"avoid_gpu"}),
    ({"state": "pending", "node": "node-b"}, {"cordon_node", "requeue_job"}),
    ({"since": 150.0}, {"avoid_gpu"}),
    ({"node": "nowhere"}, set()),
]


@pytest.mark.parametrize("filters,actions", FILTERS)
def test_hint_filters(db, filters, actions):
    # `since` is on the wall clock (the tick's hints were written at wall time 100, the ack at 200).
    with HintStore(db, wall_clock=lambda: 100.0) as store:
        pipeline_into(store, [[ecc_finding(), hang_finding(), straggler_finding()]]).tick(100.0)
        avoid = store.hints(action="avoid_gpu")[0]
        store.ack(avoid.id, now=200.0)
        assert {h.action.value for h in store.hints(**filters)} == actions


def test_finding_filters(db):
    with HintStore(db) as store:
        pipe = pipeline_into(store, [[ecc_finding(), hang_finding(), straggler_finding()], [hang_finding()]], clear_after=5.0)
        pipe.tick(100.0)
        pipe.tick(110.0)  # ecc and straggler clear
        assert {f.kind.value for f in store.findings(active=True)} == {"collective_hang"}
        assert {f.kind.value for f in store.findings(active=False)} == {"ecc", "straggler"}
        assert {f.kind.value for f in store.findings(severity="ticket")} == {"straggler"}
        assert {f.kind.value for f in store.findings(since=105.0)} == {"collective_hang"}
        assert [f.kind.value for f in store.findings(job="job-9", kind="straggler")] == ["straggler"]
        assert len(store.findings(limit=2)) == 2


@pytest.mark.parametrize(
    "make_path,message",
    [
        (lambda tmp: tmp / "missing-dir" / "hints.db", "does not exist"),
        (lambda tmp: (tmp / "junk.db").write_bytes(b"this is not sqlite at all" * 100) and tmp / "junk.db", "not a usable gpuvigil hint store"),
    ],
)
def test_bad_store_file_is_a_user_error(tmp_path, make_path, message):
    with pytest.raises(UserError, match=message):
        HintStore(make_path(tmp_path))


@pytest.mark.parametrize(
    "attempts,last_error,full_wait",
    [
        (0, None, 0.0),  # never tried
        (3, None, 0.0),  # last try succeeded (ack pending elsewhere)
        (1, "boom", 5.0),
        (2, "boom", 10.0),  # 5 * 2
        (5, "boom", 80.0),
        (10, "boom", 300.0),  # capped at 300
        (5000, "boom", 300.0),  # no float overflow
    ],
)
def test_retry_backoff_after_failed_applies(attempts, last_error, full_wait):
    from types import SimpleNamespace

    from gpuvigil.scheduler.apply import due_for_retry

    # Jittered (gpuvigil.util.backoff): the wait is within [full/2, full], fixed per hint and attempt.
    waits = []
    for hint_id in ("h1", "h2", "h3", "h4"):
        record = SimpleNamespace(id=hint_id, attempts=attempts, last_error=last_error, updated_wall=1000.0)
        wait = next(w / 100 for w in range(0, 30001) if due_for_retry(record, 1000.0 + w / 100, 5.0, 300.0))
        assert full_wait / 2 - 0.01 <= wait <= full_wait
        assert all(due_for_retry(record, 1000.0 + wait + extra, 5.0, 300.0) for extra in (0.0, 1.0, 1e6))
        if wait > 0:
            assert not due_for_retry(record, 1000.0 + wait - 0.01, 5.0, 300.0)
        waits.append(wait)
    # Hints that failed together do not retry together.
    assert full_wait == 0.0 or len(set(waits)) == len(waits)
