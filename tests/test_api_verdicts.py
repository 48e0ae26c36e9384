"""Job verdicts kept by the writer (before, a 400-finding verdict built on every read after a
write cost 6-8 ms and put the verdict p99 at 79 ms). The store rebuilds a job's verdict in every
write transaction that touches its findings or hints; these tests check that the stored verdict
always equals one computed afresh from the store's findings and hints, whoever wrote last
(this connection, another connection to the same file, an ack through the API), and that a file
written by the previous schema answers verdicts right after it is migrated."""

from __future__ import annotations

import json
import random
import sqlite3

import httpx
import pytest

from gpuvigil.util import sqlitedb
from gpuvigil.api.app import create_app, serve_api_in_thread
from gpuvigil.api.store import MIGRATIONS, HintState, HintStore
from gpuvigil.model import Finding, FindingKind, Hint, HintAction, Severity
from h_api_helpers import TOKEN

AUTH = {"Authorization": f"Bearer {TOKEN}"}
KINDS = [(FindingKind.STRAGGLER, Severity.TICKET), (FindingKind.XID, Severity.PAGE), (FindingKind.ECC, Severity.PAGE), (FindingKind.THERMAL_THROTTLE, Severity.INFO)]
JOBS = ["j0", "j1", "j2", None]


def _random_tick(rng: random.Random, t: int, seen: list[Finding]) -> tuple[list[Finding], list[Finding], list[Hint]]:
    active, hints = [], []
    for i in range(rng.randint(3, 25)):
        job, node = rng.choice(JOBS), f"n{rng.randint(0, 5)}"
        kind, sev = rng.choice(KINDS)
        evidence: dict = {}
        r = rng.random()
        if r < 0.4:
            evidence["culprit_nodes"] = rng.sample([f"n{k}" for k in range(6)], rng.randint(0, 3))
        elif r < 0.5:
            evidence["culprit_nodes"] = "not a list"  # ignored: the finding's own node counts
        ranks = rng.sample(range(8), rng.randint(0, 3))
        f = Finding(
            kind=kind, severity=sev, ts=100.0 + t, job=job, node=node if rng.random() < 0.9 else None, gpu=rng.randint(0, 7),
            xid=79 if kind == FindingKind.XID else None, ranks=ranks, culprit_ranks=ranks, evidence=evidence, summary=f"{kind.value} #{i}",
            source="test", cause="hardware",
        )
        active.append(f)
        if rng.random() < 0.7:
            # Sometimes a hint for another job (a drain of the culprit node hits its neighbours).
            hints.append(Hint(action=rng.choice([HintAction.AVOID_GPU, HintAction.DRAIN_NODE]), ts=f.ts, reason=f.summary, finding_id=f.id,
                              finding_kind=f.kind, job=rng.choice([job, job, "other"]), node=node, gpu=f.gpu))
    seen.extend(active)
    cleared = rng.sample(seen, min(len(seen), rng.randint(0, 6)))
    return active, cleared, hints


def _expected(store: HintStore, job: str) -> dict | None:
    """The verdict's content computed afresh from the store's own records."""
    fs = store.findings(job=job, active=True, worst_first=True)
    if not fs:
        return None
    ids = {f.id for f in fs}
    live = [h for h in store.hints() if h.state in (HintState.PENDING, HintState.ACKED) and h.finding_id in ids]
    own = sorted((h for h in live if h.job == job), key=lambda h: h.seq)
    other = sorted((h for h in live if h.job != job), key=lambda h: (h.finding_id, h.seq))
    nodes: set[str] = set()
    for f in fs:
        named = f.evidence.get("culprit_nodes")
        nodes |= {str(n) for n in named} if isinstance(named, list) else ({f.node} if f.node else set())
    return {
        "findings": [f.id for f in fs],
        "recommended_actions": [(h.id, h.state.value, h.seq) for h in own + other],
        "culprit_ranks": sorted({r for f in fs for r in f.culprit_ranks}),
        "culprit_nodes": sorted(nodes),
        "summary": f"{fs[0].kind.value}: {fs[0].summary}" + (f" (+{len(fs) - 1} more finding(s))" if len(fs) > 1 else ""),
        "status": "unhealthy" if any(f.severity == Severity.PAGE for f in fs) else "degraded" if any(f.severity == Severity.TICKET for f in fs) else "healthy",
    }


def _got(client: httpx.Client, job: str) -> dict | None:
    r = client.get(f"/v1/jobs/{job}/verdict")
    assert r.status_code == 200, r.text
    v = r.json()
    if not v["findings"]:
        assert v["summary"] == "no active findings" and v["status"] == "healthy" and v["recommended_actions"] == []
        return None
    return {
        "findings": [f["id"] for f in v["findings"]],
        "recommended_actions": [(h["id"], h["state"], h["seq"]) for h in v["recommended_actions"]],
        "culprit_ranks": v["culprit_ranks"],
        "culprit_nodes": v["culprit_nodes"],
        "summary": v["summary"],
        "status": v["status"],
    }


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_stored_verdicts_equal_a_fresh_computation_whoever_writes(tmp_path, seed):
    rng = random.Random(seed)
    path = tmp_path / "hints.db"
    store = HintStore(path)
    other = HintStore(path)  # another writer on the same file, as `gpuvigil api` next to `serve`
    srv = serve_api_in_thread(create_app(store, TOKEN))
    seen: list[Finding] = []
    try:
        with httpx.Client(base_url=srv.url, headers=AUTH) as client:
            for t in range(10):
                active, cleared, hints = _random_tick(rng, t, seen)
                (store if t % 2 else other).record(now=100.0 + t, active_findings=active, cleared_findings=cleared, new_hints=hints, jobs=["j0", "j1", "j2"])
                for h in rng.sample(store.hints(), min(4, len(store.hints()))):
                    how = rng.choice(["api_ack", "api_nack", "other_ack", "note"])
                    if how == "note":
                        other.note(h.id, "dry_run", f"would act on {h.id}")
                    elif how == "other_ack" and h.state == HintState.PENDING:
                        other.ack(h.id, "from the other connection")
                    elif h.state == HintState.PENDING:
                        verb, body = ("ack", {"note": "done"}) if how == "api_ack" else ("nack", {"reason": "busy"})
                        assert client.post(f"/v1/hints/{h.id}/{verb}", json=body).status_code == 200
                for job in ("j0", "j1", "j2"):
                    assert _got(client, job) == _expected(store, job), (t, job)
    finally:
        srv.stop()
        other.close()
        store.close()


def test_a_job_whose_findings_all_cleared_is_healthy_and_an_unknown_one_404(tmp_path):
    f = Finding(kind=FindingKind.XID, severity=Severity.PAGE, ts=100.0, job="jx", node="n1", gpu=0, xid=79, summary="xid 79", source="test", cause="hardware")
    with HintStore(tmp_path / "h.db") as store:
        store.record(now=100.0, active_findings=[f])
        srv = serve_api_in_thread(create_app(store, TOKEN))
        try:
            with httpx.Client(base_url=srv.url, headers=AUTH) as client:
                assert client.get("/v1/jobs/jx/verdict").json()["status"] == "unhealthy"
                store.record(now=200.0, cleared_findings=[f])
                v = client.get("/v1/jobs/jx/verdict").json()
                assert (v["status"], v["summary"], v["findings"]) == ("healthy", "no active findings", [])
                assert store._query("SELECT COUNT(*) FROM job_verdicts")[0][0] == 0
                assert client.get("/v1/jobs/nobody/verdict").status_code == 404
        finally:
            srv.stop()


def test_a_file_of_the_previous_schema_answers_verdicts_once_migrated(tmp_path):
    path = tmp_path / "v2.db"
    db = sqlitedb.connect(path, what="test")
    sqlitedb.migrate(db, MIGRATIONS[:2], what="test")  # the schema before verdicts were stored
    f = Finding(kind=FindingKind.ECC, severity=Severity.PAGE, ts=100.0, job="old-job", node="n7", gpu=2, culprit_ranks=[5], summary="2 DBEs", source="test", cause="hardware")
    h = Hint(action=HintAction.DRAIN_NODE, ts=100.0, reason="2 DBEs", finding_id=f.id, finding_kind=f.kind, job="old-job", node="n7", gpu=2)
    with sqlitedb.transaction(db):
        db.execute(
            "INSERT INTO findings VALUES (?, 'ecc', 'page', 'old-job', 'n7', 2, 100, 150, NULL, 1, 3, ?)", (f.id, json.dumps(f.to_json_dict(), sort_keys=True))
        )
        db.execute(
            "INSERT INTO hints VALUES (?, 'drain_node', ?, 'ecc', 'old-job', 'n7', 2, 100, 150, 3, 'acked', 'drained', 120, 120, 0, NULL, 1, ?)",
            (h.id, f.id, json.dumps(h.to_json_dict(), sort_keys=True)),
        )
    db.close()
    with HintStore(path) as store:
        assert sqlitedb.user_version(store._db) == len(MIGRATIONS)
        v = json.loads(store._query("SELECT findings FROM job_verdicts WHERE job = 'old-job'")[0][0])
        assert [x["id"] for x in v] == [f.id] and v[0]["occurrences"] == 3 and v[0]["last_seen"] == 150
        assert store.findings(job="old-job")[0].first_seen == 100  # rows kept through the rebuild
        srv = serve_api_in_thread(create_app(store, TOKEN))
        try:
            got = httpx.get(f"{srv.url}/v1/jobs/old-job/verdict", headers=AUTH).json()
        finally:
            srv.stop()
        assert got["status"] == "unhealthy" and got["culprit_ranks"] == [5] and got["culprit_nodes"] == ["n7"]
        assert [(a["id"], a["state"], a["state_reason"]) for a in got["recommended_actions"]] == [(h.id, "acked", "drained")]
    raw = sqlite3.connect(path)
    assert {r[0] for r in raw.execute("SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = 'hints' AND sql IS NOT NULL")} >= {"hints_seq", "hints_finding_seq"}
    raw.close()
