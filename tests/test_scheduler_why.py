"""Decision records of the built-in scheduler ("why is my job there / still waiting"): what
each cycle records, that it stays bounded, `GET /v1/jobs/{id}/why` and `gpuvigil why JOB`
against a real uvicorn server and against a running `gpuvigil serve`."""

from __future__ import annotations

import threading

import httpx
import pytest
from fastapi.testclient import TestClient

from gpuvigil import config
from gpuvigil.api.app import create_app, serve_api_in_thread
from gpuvigil.api.store import HintStore
from gpuvigil.api.why import NO_SCHEDULER, JobWhy
from gpuvigil.cli.main import build_parser, main
from gpuvigil.model import FindingKind, Hint, HintAction
from gpuvigil.scheduler import JobSpec, NodeSpec, Scheduler
from gpuvigil.scheduler.state import Decision, DecisionLog
from h_api_helpers import TOKEN
from services import free_port, wait_for

AUTH = {"Authorization": f"Bearer {TOKEN}"}


def sched(nodes, **overrides) -> Scheduler:
    return Scheduler(nodes, config.load(overrides={"scheduler": overrides}) if overrides else None)


def nodes(n: int, gpus: int = 8, model: str = "H200", racks: int = 1) -> list[NodeSpec]:
    return [NodeSpec(f"n{i}", rack=f"r{i * racks // n}", n_gpus=gpus, gpu_model=model) for i in range(n)]


def last(s: Scheduler, job: str) -> dict:
    return s.why(job)["decisions"][-1]


# -- what a cycle records -------------------------------------------------------------------------


def test_placement_records_each_plugin_score_and_the_next_best_nodes():
    s = sched(nodes(3))
    s.submit(JobSpec("busy", 6), 0)
    s.cycle(0)
    s.submit(JobSpec("j", 2), 1)
    s.cycle(1)
    d = last(s, "j")
    assert d["outcome"] == "placed" and d["nodes"] == [s.jobs["j"].placement[0][0]]
    # Best-fit packs the 2-GPU job next to `busy` (the node with 2 GPUs left).
    assert d["nodes"] == [s.jobs["busy"].placement[0][0]]
    assert set(d["scores"]) == {"fragmentation", "best_fit", "topology", "health"}
    total = sum(d["scores"].values())
    others = {a["node"] for a in d["alternatives"]}
    assert others == {"n0", "n1", "n2"} - set(d["nodes"])
    assert all(a["score"] <= total + 1e-9 for a in d["alternatives"])
    assert "placed on" in d["reason"]


def test_waiting_gang_names_the_stage_that_ruled_out_each_node_class():
    cluster = nodes(2, model="H200") + [NodeSpec(f"m{i}", n_gpus=8, gpu_model="A100") for i in range(3)]
    s = sched(cluster)
    s.nodes["n0"].state, s.nodes["n0"].reason = "cordoned", "xid 79 on GPU 3"
    s.submit(JobSpec("small", 4), 0)
    s.cycle(0)
    s.submit(JobSpec("big", 32, gpus_per_node=8), 1)
    # A hint requeued the gang away from m2 earlier (the filter of the health plugin).
    s.jobs["big"].excluded_nodes.add("m2")
    s.cycle(1)
    s.cycle(2)
    why = s.why("big")
    assert why["state"] == "pending" and why["summary"].startswith("pending: gang of 32 GPUs in blocks of 8")
    d = why["decisions"][-1]
    assert d["outcome"] == "waiting" and d["blocker"] == "gang"
    stages = {r["stage"]: r for r in d["rejected"]}
    assert stages["node state"]["examples"] == ["n0"] and "cordoned" in stages["node state"]["reason"] and "xid 79" in stages["node state"]["reason"]
    assert stages["filter health"]["examples"] == ["m2"] and "excluded" in stages["filter health"]["reason"]
    small_node = s.jobs["small"].placement[0][0]
    assert stages["resources"]["examples"] == [small_node] and stages["resources"]["reason"] == "fewer than 8 idle whole GPU(s)"
    # Every node is counted once, at its first rejecting stage; the rest could take part.
    assert sum(r["nodes"] for r in d["rejected"]) == 3
    assert "the 2 node(s) that could take part offer 16" in d["reason"]
    assert stages["filter health"]["node_types"] == {"A100 x8": 1}
    # Two equal cycles: one entry.
    assert [(x["first_ts"], x["ts"], x["cycles"]) for x in why["decisions"]] == [(1, 2, 2)]


def test_quota_veto_is_the_blocker():
    s = sched(nodes(1), quota={"tenants": {"a": {"gpus": 4}}, "borrow": False})
    s.submit(JobSpec("a1", 4, tenant="a"), 0)
    s.submit(JobSpec("a2", 2, tenant="a"), 0)
    s.cycle(0)
    d = last(s, "a2")
    assert d["outcome"] == "waiting" and d["blocker"] == "quota"
    assert "tenant 'a' would exceed its quota of 4 GPUs" in d["reason"]


def test_jobs_behind_a_reserving_p0_say_who_holds_them():
    s = sched(nodes(1), actions=["enqueue", "allocate", "backfill"])  # nobody preempts
    s.submit(JobSpec("run", 4), 0)
    s.cycle(0)
    s.submit(JobSpec("p0", 8, priority="P0"), 1)
    s.submit(JobSpec("p2", 2, priority="P2"), 1)
    s.cycle(1)
    assert last(s, "p0")["outcome"] == "waiting"
    d = last(s, "p0")
    assert d["nodes"] == ["n0"] and "holding 1 node(s) for it (n0)" in d["reason"]
    d = last(s, "p2")
    assert d["outcome"] == "waiting" and d["blocker"] == "reservation by p0"
    assert [(r["stage"], r["reason"]) for r in d["rejected"]] == [("reservation", "held for p0 (blocked, reserving class) until it starts")]
    s.cycle(2)  # the same two decisions again: merged, not alternating
    assert [x["cycles"] for x in s.why("p0")["decisions"]] == [2]


def test_preemption_notice_is_recorded_with_its_grace():
    s = sched(nodes(1))
    s.submit(JobSpec("low", 8, priority="P2"), 0)
    s.cycle(0)
    s.submit(JobSpec("p1", 8, priority="P1"), 1)
    s.cycle(1)
    d = last(s, "p1")
    assert d["outcome"] == "preempting" and "preempting low (300 s grace" in d["reason"]
    s.cycle(302)
    d = last(s, "p1")
    assert d["outcome"] == "placed" and "after preemption" in d["reason"]
    assert any(a["action"] == "preempted" for a in s.why("low")["recent_actions"])


def test_a_job_that_can_never_fit_is_recorded_as_failed():
    s = sched(nodes(1))
    s.submit(JobSpec("huge", 64), 0)
    s.cycle(0)
    d = last(s, "huge")
    assert d["outcome"] == "failed" and "needs 64 GPUs, the cluster has 8" in d["reason"]
    assert s.why("nobody") is None


def test_a_requeue_by_hint_shows_in_the_job_s_story():
    s = sched(nodes(2))
    s.submit(JobSpec("j", 8), 0)
    s.cycle(0)
    node = s.jobs["j"].placement[0][0]
    s.apply_hint(Hint(action=HintAction.REQUEUE_JOB, ts=5.0, reason="NCCL hang on " + node, finding_id="f", finding_kind=FindingKind.COLLECTIVE_HANG, job="j", exclude_nodes=[node]), 5.0)
    s.cycle(5)
    why = s.why("j")
    assert why["state"] == "running" and why["excluded_nodes"] == [node] and node not in {n for n, _ in s.jobs["j"].placement}
    assert [a["action"] for a in why["recent_actions"]] == ["placed", "requeued", "placed"]
    assert "NCCL hang" in why["recent_actions"][1]["detail"]


# -- bounded --------------------------------------------------------------------------------------


def test_equal_decisions_merge_and_history_is_bounded():
    s = sched(nodes(1), explain={"per_job": 3, "max_jobs": 4})
    s.submit(JobSpec("fill", 8), 0)
    s.submit(JobSpec("w", 8), 0)
    for t in range(100):
        s.cycle(float(t))
    w = s.why("w")["decisions"]
    assert len(w) == 1 and w[0]["cycles"] == 100 and w[0]["first_ts"] == 0 and w[0]["ts"] == 99
    log = DecisionLog(per_job=3, max_jobs=4)
    for i in range(10):
        log.record("a", Decision(float(i), "waiting", f"reason {i}"))
    assert [d["reason"] for d in log.history("a")] == ["reason 7", "reason 8", "reason 9"]
    for j in range(6):
        log.record(f"j{j}", Decision(0.0, "waiting", "x"))
    assert len(log) == 4 and not log.knows("a") and log.knows("j5")
    off = DecisionLog(enabled=False)
    off.record("a", Decision(0.0, "waiting", "x"))
    assert len(off) == 0


def test_explain_config_is_validated():
    with pytest.raises(config.ConfigError, match="per_job"):
        config.load(overrides={"scheduler": {"explain": {"per_job": 0}}})


# -- API and CLI ---------------------------------------------------------------------------------


@pytest.fixture
def waiting_scheduler():
    s = sched(nodes(2))
    s.nodes["n1"].state, s.nodes["n1"].reason = "drained", "ecc uncorrectable"
    s.submit(JobSpec("fill", 8), 0)
    s.submit(JobSpec("train-7", 16, gpus_per_node=8), 0)
    s.cycle(0)
    return s


def test_api_serves_the_decisions_and_404s(tmp_path, waiting_scheduler):
    with HintStore(tmp_path / "h.db") as store:
        with TestClient(create_app(store, TOKEN, why=waiting_scheduler.why)) as c:
            r = c.get("/v1/jobs/train-7/why", headers=AUTH)
            assert r.status_code == 200
            body = JobWhy.model_validate(r.json())
            assert body.state == "pending" and body.decisions[-1].blocker == "gang"
            assert {x.stage for x in body.decisions[-1].rejected} == {"node state", "resources"}
            r = c.get("/v1/jobs/nobody/why", headers=AUTH)
            assert r.status_code == 404 and "does not know job 'nobody'" in r.json()["detail"]
            assert c.get("/v1/jobs/train-7/why").status_code == 401
            assert "/v1/jobs/{job}/why" in c.get("/openapi.json").json()["paths"]
        with TestClient(create_app(store, TOKEN)) as c:
            r = c.get("/v1/jobs/train-7/why", headers=AUTH)
            assert r.status_code == 404 and r.json()["detail"] == NO_SCHEDULER


def test_why_command_against_a_real_server(tmp_path, waiting_scheduler, capsys, monkeypatch):
    monkeypatch.setenv("GPUVIGIL_API_TOKEN", TOKEN)
    with HintStore(tmp_path / "h.db") as store:
        srv = serve_api_in_thread(create_app(store, TOKEN, why=waiting_scheduler.why))
        try:
            assert main(["why", "train-7", "--url", srv.url]) == 0
            out = capsys.readouterr().out
            assert "job train-7 (P2, tenant default, 16 GPU(s)): pending: gang of 16 GPUs in blocks of 8" in out
            assert "1 node(s) [H200 x8: 1] ruled out by node state: drained (e.g. ecc uncorrectable) (e.g. n1)" in out
            assert "[held by: gang]" in out
            assert main(["why", "fill", "--url", srv.url]) == 0
            out = capsys.readouterr().out
            assert "running on n0" in out and "scores: fragmentation" in out
            assert main(["why", "nobody", "--url", srv.url]) == 2
            err = capsys.readouterr().err.strip().splitlines()
            assert len(err) == 1 and "job 'nobody': the scheduler does not know job 'nobody'" in err[0]
            monkeypatch.setenv("GPUVIGIL_API_TOKEN", "x" * 32)
            assert main(["why", "fill", "--url", srv.url]) == 2
            assert "refused the token" in capsys.readouterr().err
        finally:
            srv.stop()
    port = free_port()
    assert main(["why", "fill", "--url", f"http://127.0.0.1:{port}", "--timeout", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"cannot reach the feedback API at http://127.0.0.1:{port}" in err[0]


def test_serve_answers_why_for_its_scheduler_s_jobs(tmp_path, capsys):
    """`gpuvigil serve` (simulated cluster) attaches its built-in scheduler to the API."""
    from gpuvigil.app.serve import Server

    argv = ["serve", "--port", "0", "--scenario", "node_xid79", "--speed", "1000", "--api-port", "0", "--insecure-local", "--hint-db", str(tmp_path / "h.db")]
    server = Server(build_parser(argv).parse_args(argv))
    server.start()

    def run() -> None:
        server.args.duration = 30
        server.loop()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        with server.lock:
            jobs = sorted(server.runtime.scheduler.jobs)
        assert jobs
        url = server.api_server.url
        body = wait_for(lambda: (r := httpx.get(f"{url}/v1/jobs/{jobs[0]}/why", timeout=10)).status_code == 200 and r.json(), timeout=30, what="why to answer")
        assert body["job"] == jobs[0] and body["decisions"]
        assert main(["why", jobs[0], "--url", url]) == 0
        assert f"job {jobs[0]} (" in capsys.readouterr().out
        assert httpx.get(f"{url}/v1/jobs/no-such-job/why", timeout=10).status_code == 404
    finally:
        server.stop()
        thread.join(timeout=30)
        server.close()
