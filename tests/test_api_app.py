"""The feedback API over HTTP: bearer auth, OpenAPI served, hint listing/filters, ack/nack,
node health, job verdicts, persistence across an app restart, the SSE stream on a real uvicorn
server, and the `gpuvigil api` command's refusal rules."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from gpuvigil.api.app import create_app, serve_api_in_thread
from gpuvigil.api.auth import check_bind, resolve_token
from gpuvigil.api.store import HintState, HintStore
from gpuvigil.errors import UserError
from h_api_helpers import TOKEN, ecc_finding, hang_finding, pipeline_into, straggler_finding

REPO = Path(__file__).resolve().parents[1]
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def store(tmp_path):
    # Wall clock 100 for the tick's writes, like the pipeline clock (`since` filters hints on the wall clock).
    s = HintStore(tmp_path / "hints.db", wall_clock=lambda: 100.0)
    pipe = pipeline_into(s, [[ecc_finding(), hang_finding(), straggler_finding()]], clear_after=1e9)
    pipe.tick(100.0)
    yield s
    s.close()


@pytest.fixture
def client(store):
    with TestClient(create_app(store, TOKEN)) as c:
        yield c


ENDPOINTS = [
    ("GET", "/v1/hints"),
    ("GET", "/v1/findings"),
    ("GET", "/v1/nodes/node-a/health"),
    ("GET", "/v1/jobs/job-7/verdict"),
    ("POST", "/v1/hints/0123456789abcdef/ack"),
    ("POST", "/v1/hints/0123456789abcdef/nack"),
    ("GET", "/v1/hints/stream"),
]
BAD_AUTH = [
    ({}, "missing bearer token"),
    ({"Authorization": "Bearer wrong-token-wrong-token-wrong"}, "wrong bearer token"),
    ({"Authorization": f"Bearer {TOKEN}x"}, "wrong bearer token"),
    ({"Authorization": f"Basic {TOKEN}"}, "missing bearer token"),
    ({"Authorization": "Bearer "}, "missing bearer token"),
]


@pytest.mark.parametrize("method,path", ENDPOINTS)
@pytest.mark.parametrize("headers,detail", BAD_AUTH)
def test_every_v1_route_needs_the_right_bearer_token(client, method, path, headers, detail):
    r = client.request(method, path, headers=headers, json={"reason": "x"})
    assert r.status_code == 401
    assert r.json()["detail"] == detail
    assert r.headers["www-authenticate"] == "Bearer"


def test_right_token_is_admitted(client, store):
    r = client.get("/v1/hints", headers=AUTH)
    assert r.status_code == 200
    body = r.json()
    assert body["count"] == len(store.hints()) == 4
    assert body["latest_seq"] == store.latest_seq()


def test_openapi_schema_and_docs_are_served(client):
    spec = client.get("/openapi.json").json()
    assert set(spec["paths"]) >= {
        "/v1/hints",
        "/v1/hints/{hint_id}/ack",
        "/v1/hints/{hint_id}/nack",
        "/v1/hints/stream",
        "/v1/nodes/{node}/health",
        "/v1/jobs/{job}/verdict",
        "/v1/findings",
    }
    assert spec["components"]["securitySchemes"]["HTTPBearer"] == {
        "type": "http",
        "scheme": "bearer",
        "description": "the token in $GPUVIGIL_API_TOKEN or --token-file",
    }
    hint_record = spec["components"]["schemas"]["HintRecord"]["properties"]
    assert {"state", "occurrences", "seq", "finding_kind", "exclude_nodes"} <= set(hint_record)
    assert spec["paths"]["/v1/hints"]["get"]["security"] == [{"HTTPBearer": []}]
    docs = client.get("/docs")
    assert docs.status_code == 200 and "swagger-ui" in docs.text


HINT_FILTERS = [
    ("node=node-a", {("drain_node", "node-a")}),
    ("job=job-7", {("cordon_node", "node-b"), ("requeue_job", "node-b")}),
    ("action=avoid_gpu", {("avoid_gpu", "node-c")}),
    ("state=pending&node=node-c", {("avoid_gpu", "node-c")}),
    ("state=acked", set()),
    ("since=100.5", set()),
    ("since=100", {("drain_node", "node-a"), ("cordon_node", "node-b"), ("requeue_job", "node-b"), ("avoid_gpu", "node-c")}),
]


@pytest.mark.parametrize("query,expected", HINT_FILTERS)
def test_hint_filters(client, query, expected):
    r = client.get(f"/v1/hints?{query}", headers=AUTH)
    assert r.status_code == 200
    assert {(h["action"], h["node"]) for h in r.json()["hints"]} == expected


@pytest.mark.parametrize("query", ["action=reboot", "state=done", "since=yesterday", "limit=0", "limit=999999"])
def test_bad_filters_are_422(client, query):
    assert client.get(f"/v1/hints?{query}", headers=AUTH).status_code == 422


def test_ack_and_nack_over_http(client, store):
    drain = store.hints(action="drain_node")[0]
    avoid = store.hints(action="avoid_gpu")[0]
    r = client.post(f"/v1/hints/{drain.id}/ack", headers=AUTH, json={"note": "scontrol drained node-a"})
    assert r.status_code == 200
    assert (r.json()["state"], r.json()["state_reason"]) == ("acked", "scontrol drained node-a")
    assert client.post(f"/v1/hints/{drain.id}/ack", headers=AUTH).status_code == 200  # retry is a no-op
    assert client.post(f"/v1/hints/{drain.id}/nack", headers=AUTH, json={"reason": "no"}).status_code == 409
    assert client.post(f"/v1/hints/{avoid.id}/nack", headers=AUTH).status_code == 422  # reason required
    assert client.post(f"/v1/hints/{avoid.id}/nack", headers=AUTH, json={"reason": ""}).status_code == 422
    r = client.post(f"/v1/hints/{avoid.id}/nack", headers=AUTH, json={"reason": "GPU already replaced"})
    assert (r.status_code, r.json()["state"], r.json()["state_reason"]) == (200, "nacked", "GPU already replaced")
    assert client.post("/v1/hints/ffffffffffffffff/ack", headers=AUTH).status_code == 404
    assert client.post("/v1/hints/bad%20id/ack", headers=AUTH).status_code == 422
    assert store.get_hint(drain.id).state == HintState.ACKED
    assert store.get_hint(avoid.id).state == HintState.NACKED


@pytest.mark.parametrize(
    "node,status,kinds",
    [
        ("node-a", "unhealthy", ["ecc"]),  # page
        ("node-c", "degraded", ["straggler"]),  # ticket
    ],
)
def test_node_health_from_active_findings(client, node, status, kinds):
    body = client.get(f"/v1/nodes/{node}/health", headers=AUTH).json()
    assert body["status"] == status
    assert [f["kind"] for f in body["findings"]] == kinds
    assert len(body["reasons"]) == len(kinds)
    if kinds:
        assert body["hints"], "a sick node has live hints"


def test_node_turns_healthy_when_its_finding_clears(tmp_path):
    with HintStore(tmp_path / "h.db") as store, TestClient(create_app(store, TOKEN)) as c:
        pipe = pipeline_into(store, [[ecc_finding()]], clear_after=10.0)
        pipe.tick(100.0)
        assert c.get("/v1/nodes/node-a/health", headers=AUTH).json()["status"] == "unhealthy"
        pipe.tick(200.0)
        body = c.get("/v1/nodes/node-a/health", headers=AUTH).json()
        assert (body["status"], body["findings"], body["hints"]) == ("healthy", [], [])


def test_job_verdict_names_culprits_and_actions(client):
    body = client.get("/v1/jobs/job-7/verdict", headers=AUTH).json()
    assert body["status"] == "unhealthy"
    assert body["summary"].startswith("collective_hang: rank 5 of job-7 never entered ALLREDUCE")
    assert body["culprit_ranks"] == [5]
    assert body["culprit_nodes"] == ["node-b"]
    assert sorted(h["action"] for h in body["recommended_actions"]) == ["cordon_node", "requeue_job"]
    requeue = next(h for h in body["recommended_actions"] if h["action"] == "requeue_job")
    assert requeue["exclude_nodes"] == ["node-b"]


def test_unknown_node_and_job_are_404_not_healthy(client):
    for path in ("/v1/nodes/node-z/health", "/v1/jobs/job-unknown/verdict"):
        r = client.get(path, headers=AUTH)
        assert r.status_code == 404, path
        assert "never seen" in r.json()["detail"]


def test_known_node_and_job_without_findings_are_healthy(tmp_path):
    """The pipeline's node and job snapshots make a name known, findings or not."""
    import polars as pl

    from gpuvigil.window import Window

    with HintStore(tmp_path / "h.db") as store, TestClient(create_app(store, TOKEN)) as c:
        window = Window()
        window.add("nodes", pl.DataFrame({"ts": [1.0], "node": ["node-q"]}))
        window.add("jobs", pl.DataFrame({"ts": [1.0], "job": ["job-q"]}))
        store.on_tick(type("R", (), {"now": 1.0, "active_findings": [], "cleared_findings": [], "new_hints": [], "expired_hints": []})(), window)
        node = c.get("/v1/nodes/node-q/health", headers=AUTH).json()
        assert (node["status"], node["findings"], node["hints"]) == ("healthy", [], [])
        job = c.get("/v1/jobs/job-q/verdict", headers=AUTH).json()
        assert (job["status"], job["summary"], job["recommended_actions"]) == ("healthy", "no active findings", [])
        assert c.get("/v1/nodes/node-r/health", headers=AUTH).status_code == 404


def test_findings_endpoint_filters(client):
    all_ = client.get("/v1/findings", headers=AUTH).json()
    assert all_["count"] == 3
    assert [f["kind"] for f in client.get("/v1/findings?severity=ticket", headers=AUTH).json()["findings"]] == ["straggler"]
    assert [f["node"] for f in client.get("/v1/findings?kind=ecc&active=true", headers=AUTH).json()["findings"]] == ["node-a"]
    assert client.get("/v1/findings?active=false", headers=AUTH).json()["count"] == 0
    assert client.get("/v1/findings?kind=nonsense", headers=AUTH).status_code == 422


def test_app_restart_over_the_same_file_loses_nothing(tmp_path):
    path = tmp_path / "hints.db"
    store = HintStore(path)
    pipeline_into(store, [[hang_finding()]]).tick(100.0)
    server = serve_api_in_thread(create_app(store, TOKEN))
    try:
        hid = httpx.get(f"{server.url}/v1/hints?action=requeue_job", headers=AUTH).json()["hints"][0]["id"]
        r = httpx.post(f"{server.url}/v1/hints/{hid}/ack", headers=AUTH, json={"note": "requeued"})
        assert r.status_code == 200
        before = httpx.get(f"{server.url}/v1/hints", headers=AUTH).json()["hints"]
    finally:
        server.stop()
        store.close()
    store = HintStore(path)
    server = serve_api_in_thread(create_app(store, TOKEN))
    try:
        after = httpx.get(f"{server.url}/v1/hints", headers=AUTH).json()["hints"]
        assert after == before
        assert next(h for h in after if h["id"] == hid)["state"] == "acked"
    finally:
        server.stop()
        store.close()


def _read_events(response: httpx.Response, want: int, deadline: float) -> list[tuple[int, dict]]:
    """Parse SSE `hint` events until `want` arrived or the deadline passed."""
    events: list[tuple[int, dict]] = []
    ev: dict[str, str] = {}
    lines = response.iter_lines()
    while len(events) < want and time.monotonic() < deadline:
        line = next(lines)
        if line == "":
            if ev.get("event") == "hint":
                events.append((int(ev["id"]), json.loads(ev["data"])))
            ev = {}
        elif not line.startswith(":") and ":" in line:
            key, _, value = line.partition(":")
            ev[key] = value.lstrip(" ")
    return events


def test_sse_stream_delivers_new_and_changed_hints_on_a_real_server(tmp_path):
    store = HintStore(tmp_path / "hints.db")
    server = serve_api_in_thread(create_app(store, TOKEN, cfg=None))
    pipe = pipeline_into(store, [[], [ecc_finding()]], clear_after=1e9)
    pipe.tick(99.0)
    try:
        timeout = httpx.Timeout(5.0, read=5.0)
        with httpx.stream("GET", f"{server.url}/v1/hints/stream", headers=AUTH, timeout=timeout) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")

            def produce():
                time.sleep(0.3)
                pipe.tick(100.0)  # new drain_node hint
                time.sleep(0.3)
                hid = store.hints()[0].id
                store.ack(hid, "drained")

            th = threading.Thread(target=produce)
            th.start()
            events = _read_events(r, 2, time.monotonic() + 10)
            th.join(10)
        assert [(e["action"], e["state"]) for _, e in events] == [("drain_node", "pending"), ("drain_node", "acked")]
        assert events[0][0] < events[1][0]
        # Reconnecting with Last-Event-ID replays what happened after that event, and only that.
        first_id = events[0][0]
        with httpx.stream("GET", f"{server.url}/v1/hints/stream", headers={**AUTH, "Last-Event-ID": str(first_id)}, timeout=timeout) as r:
            replay = _read_events(r, 1, time.monotonic() + 10)
        assert [(e["state"]) for _, e in replay] == ["acked"]
        # Filters apply to the stream too.
        with httpx.stream("GET", f"{server.url}/v1/hints/stream?after_seq=0&node=node-zzz", headers=AUTH, timeout=httpx.Timeout(5.0, read=1.5)) as r:
            with pytest.raises(httpx.ReadTimeout):
                _read_events(r, 1, time.monotonic() + 3)
        # Auth also guards the stream.
        assert httpx.get(f"{server.url}/v1/hints/stream", timeout=5).status_code == 401
    finally:
        server.stop()
        store.close()


def test_stop_returns_while_a_stream_is_open(tmp_path):
    store = HintStore(tmp_path / "hints.db")
    server = serve_api_in_thread(create_app(store, TOKEN))
    got: list[int] = []
    errors: list[BaseException] = []
    connected = threading.Event()

    def listen():
        try:
            with httpx.stream("GET", f"{server.url}/v1/hints/stream", headers=AUTH, timeout=30) as r:
                got.append(r.status_code)
                connected.set()
                for _ in r.iter_lines():
                    pass
        except BaseException as exc:  # noqa: BLE001 - reported to the test below, not swallowed
            errors.append(exc)
        finally:
            connected.set()

    th = threading.Thread(target=listen, daemon=True)
    th.start()
    try:
        assert connected.wait(15), "the stream never answered"
        assert got == [200], errors
        server.stop(timeout=15)
        assert not server._thread.is_alive()
        th.join(15)
        assert not th.is_alive()
        # The stream ends with the server: cleanly, or cut (the server is gone), never any
        # other error (a timeout would mean stop() left the stream hanging).
        assert all(isinstance(e, (httpx.RemoteProtocolError, httpx.ReadError)) for e in errors), errors
    finally:
        server.stop(timeout=5)
        store.close()


# -- starting rules -------------------------------------------------------------------------
@pytest.mark.parametrize(
    "host,token,insecure,error",
    [
        ("127.0.0.1", None, False, "no API token configured"),
        ("127.0.0.1", None, True, None),
        ("::1", None, True, None),
        ("localhost", None, True, None),
        ("0.0.0.0", None, True, "refusing to bind 0.0.0.0"),
        ("10.1.2.3", None, True, "refusing to bind 10.1.2.3"),
        ("0.0.0.0", TOKEN, False, None),
        ("0.0.0.0", TOKEN, True, "refusing to bind 0.0.0.0"),
    ],
)
def test_bind_rules(host, token, insecure, error):
    if error is None:
        check_bind(host, token, insecure)
    else:
        with pytest.raises(UserError, match=error):
            check_bind(host, token, insecure)


def test_app_without_token_needs_insecure_local_and_loopback(tmp_path):
    with HintStore(tmp_path / "h.db") as store:
        with pytest.raises(UserError, match="needs a token"):
            create_app(store, None)
        app = create_app(store, None, insecure_local=True)
        with pytest.raises(UserError, match="127.0.0.1 only"):
            serve_api_in_thread(app, host="0.0.0.0")
        with TestClient(app) as c:
            assert c.get("/v1/hints").status_code == 200


@pytest.mark.parametrize(
    "file_text,env,expected",
    [
        (None, {}, None),
        (None, {"GPUVIGIL_API_TOKEN": TOKEN}, TOKEN),
        (TOKEN + "\n", {}, TOKEN),
        (TOKEN, {"GPUVIGIL_API_TOKEN": "z" * 32}, TOKEN),  # the file wins
        ("", {}, UserError),
        ("short", {}, UserError),
        (None, {"GPUVIGIL_API_TOKEN": ""}, UserError),
        ("two words here, long enough", {}, UserError),
    ],
)
def test_resolve_token(tmp_path, file_text, env, expected):
    path = None
    if file_text is not None:
        path = tmp_path / "token"
        path.write_text(file_text)
    if expected is UserError:
        with pytest.raises(UserError):
            resolve_token(path, env)
    else:
        assert resolve_token(path, env) == expected


def test_unreadable_token_file_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="cannot read token file"):
        resolve_token(tmp_path / "nope", {})


def _cli(args, env_extra=None, **kw):
    env = {k: v for k, v in os.environ.items() if k != "GPUVIGIL_API_TOKEN"}
    env.update(env_extra or {})
    return subprocess.Popen([sys.executable, "-m", "gpuvigil", "api", *args], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


@pytest.mark.parametrize(
    "args,env,message",
    [
        ([], {}, "no API token configured"),
        (["--insecure-local", "--host", "0.0.0.0"], {}, "--insecure-local serves on 127.0.0.1 only; refusing to bind 0.0.0.0"),
        ([], {"GPUVIGIL_API_TOKEN": "abc"}, "API token is 3 characters"),
        (["--port", "70000"], {"GPUVIGIL_API_TOKEN": TOKEN}, "--port 70000"),
    ],
)
def test_cli_refuses_to_start(tmp_path, monkeypatch, capsys, args, env, message):
    from gpuvigil.cli.main import main

    monkeypatch.delenv("GPUVIGIL_API_TOKEN", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert main(["api", "--db", str(tmp_path / "h.db"), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "h.db").exists(), "refused before creating the store"


def test_cli_serves_with_a_token_file(tmp_path):
    db = tmp_path / "h.db"
    with HintStore(db) as store:
        pipeline_into(store, [[ecc_finding()]]).tick(100.0)
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    p = _cli(["--db", str(db), "--port", "0", "--token-file", str(token_file), "--log-level", "warning"])
    try:
        line = p.stdout.readline()
        url = json.loads(line)["listening"]
        assert httpx.get(f"{url}/v1/hints", timeout=10).status_code == 401
        r = httpx.get(f"{url}/v1/hints", headers=AUTH, timeout=10)
        assert r.status_code == 200 and [h["action"] for h in r.json()["hints"]] == ["drain_node"]
    finally:
        p.terminate()
        p.communicate(timeout=30)
