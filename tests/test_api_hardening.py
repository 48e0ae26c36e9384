"""The feedback API under hostile and malformed input: the token is checked before a
byte of the body is read, bodies are bounded (413) without being buffered, request bodies are
never echoed, crafted input gets 4xx (never 500), SSE framing survives every Unicode line
separator, the listener sets TCP_NODELAY, and simulated and wall-clock times never share a field.

All against the real app: TestClient for plain requests, a real uvicorn server and raw sockets
where what matters is what goes over the wire before the body is sent.
"""

from __future__ import annotations

import json
import re
import socket
import time

import httpx
import pytest
from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuvigil import config
from gpuvigil.api.app import _sse, bind_socket, create_app, serve_api_in_thread
from gpuvigil.api.store import HintStore
from h_api_helpers import TOKEN, ecc_finding, pipeline_into

AUTH = {"Authorization": f"Bearer {TOKEN}"}
SMALL_LIMIT = 4096


@pytest.fixture
def store(tmp_path):
    s = HintStore(tmp_path / "hints.db")
    pipeline_into(s, [[ecc_finding()]], clear_after=1e9).tick(100.0)
    yield s
    s.close()


@pytest.fixture
def client(store):
    with TestClient(create_app(store, TOKEN)) as c:
        yield c


@pytest.fixture
def hint_id(store):
    return store.hints()[0].id


@pytest.fixture
def server(store):
    cfg = config.load(overrides={"api": {"max_body_bytes": SMALL_LIMIT}})
    srv = serve_api_in_thread(create_app(store, TOKEN, cfg=cfg))
    yield srv
    srv.stop()


def _raw(server, head: str, body: bytes = b"", *, read_timeout: float = 10.0) -> bytes:
    """Send a request head (and part of a body) on a raw socket; return what the server answers
    without the rest of the body ever being sent."""
    with socket.create_connection((server.host, server.port), timeout=read_timeout) as sock:
        sock.sendall(head.encode() + b"\r\n" + body)
        data = b""
        deadline = time.monotonic() + read_timeout
        while b"\r\n\r\n" not in data and time.monotonic() < deadline:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
        return data


def _status(response: bytes) -> int:
    m = re.match(rb"HTTP/1\.[01] (\d{3})", response)
    assert m, response[:200]
    return int(m[1])


# -- token and size before the body -----------------------------------------------------------
def test_unauthenticated_huge_body_is_refused_before_it_is_sent(server, hint_id):
    """52 MB announced, 1 KB sent: the 401 comes back without the server waiting for the rest."""
    head = (
        f"POST /v1/hints/{hint_id}/nack HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {52 * 1024 * 1024}\r\n"
    )
    resp = _raw(server, head, b'{"reason": "' + b"x" * 1024)
    assert _status(resp) == 401
    assert b"www-authenticate: Bearer" in resp.lower().replace(b"bearer", b"Bearer")


def test_unauthenticated_bad_body_is_401_not_422(client, hint_id):
    r = client.post(f"/v1/hints/{hint_id}/nack", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 401


def test_authenticated_body_over_the_limit_by_content_length_is_413(server, hint_id):
    head = (
        f"POST /v1/hints/{hint_id}/nack HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {SMALL_LIMIT + 1}\r\n"
    )
    assert _status(_raw(server, head, b"{")) == 413


def test_chunked_body_over_the_limit_is_413_while_streaming(server, hint_id):
    """No Content-Length: the size is counted as chunks arrive and the request stops at the limit."""

    def chunks():
        yield b'{"reason": "'
        for _ in range(16):
            yield b"y" * 1024
        yield b'"}'

    r = httpx.post(f"{server.url}/v1/hints/{hint_id}/nack", content=chunks(), headers={**AUTH, "Content-Type": "application/json"}, timeout=10)
    assert r.status_code == 413
    assert "larger than 4096 bytes" in r.json()["detail"]


def test_body_under_the_limit_still_works_on_the_real_server(server, hint_id):
    r = httpx.post(f"{server.url}/v1/hints/{hint_id}/nack", json={"reason": "node hosts a P0 job"}, headers=AUTH, timeout=10)
    assert (r.status_code, r.json()["state"]) == (200, "nacked")


def test_limit_is_configuration(store):
    for bad in (0, 10):
        with pytest.raises(Exception, match="max_body_bytes"):
            create_app(store, TOKEN, cfg=config.load(overrides={"api": {"max_body_bytes": bad}}))


# -- never echo, never 500 --------------------------------------------------------------------
def test_invalid_body_is_not_echoed(client, hint_id):
    marker = "ECHO-" + "z" * 200_000
    r = client.post(f"/v1/hints/{hint_id}/nack", json={"reason": 12345, "note": marker, "junk": [marker]}, headers=AUTH)
    assert r.status_code == 422
    assert marker[:20] not in r.text and len(r.content) < 2000
    r = client.post(f"/v1/hints/{hint_id}/nack", content=b'{"reason": "' + marker.encode() + b'"', headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 422 and marker[:20] not in r.text


CRAFTED = [
    ("nack", '{"reason": "   "}'),  # blank reason (the store would refuse it)
    ("nack", '{"reason": "\\t\\n"}'),
    ("nack", '{"reason": "\\ud800"}'),  # lone surrogate
    ("nack", '{"reason": NaN}'),
    ("ack", '{"note": "\\udfff tail"}'),
    ("ack", '{"note": NaN}'),
    ("ack", '{"note": Infinity}'),
    ("ack", '{"note": ["\\ud800"]}'),
    ("ack", '[1, 2'),
    ("ack", '"just a string"'),
]


@pytest.mark.parametrize("op,body", CRAFTED)
def test_crafted_bodies_are_4xx_never_500(client, hint_id, store, op, body):
    before = store.get_hint(hint_id)
    r = client.post(f"/v1/hints/{hint_id}/{op}", content=body.encode(), headers={**AUTH, "Content-Type": "application/json"})
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    r.json()  # the error itself is valid JSON
    assert store.get_hint(hint_id).state == before.state


@pytest.mark.parametrize(
    "path,headers",
    [
        ("/v1/hints/stream", {"Last-Event-ID": "²".encode()}),  # on the wire as UTF-8
        ("/v1/hints/stream", {"Last-Event-ID": "²".encode("latin-1")}),  # "²".isdigit() is true
        ("/v1/hints/stream", {"Last-Event-ID": "١٢".encode()}),  # Arabic-Indic digits
        ("/v1/hints/stream", {"Last-Event-ID": "99999999999999999999"}),
        ("/v1/hints/stream", {"Last-Event-ID": "-3"}),
        ("/v1/hints/stream?after_seq=100000000000000000000", {}),
        ("/v1/hints/stream?after_seq=-1", {}),
        ("/v1/hints?since=nan", {}),
        ("/v1/hints?since=inf", {}),
        ("/v1/findings?since=-inf", {}),
        ("/v1/hints?limit=100000000000000000000", {}),
    ],
)
def test_crafted_query_and_headers_are_4xx(client, path, headers):
    r = client.get(path, headers={**AUTH, **headers})
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])


def test_largest_after_seq_streams(server):
    """The biggest accepted cursor opens a stream that stays up (it used to die on OverflowError)."""
    with httpx.stream("GET", f"{server.url}/v1/hints/stream?after_seq={2**63 - 1}", headers=AUTH, timeout=httpx.Timeout(5.0, read=1.5)) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(lines) == "retry: 2000"
        with pytest.raises(httpx.ReadTimeout):
            for _ in lines:  # nothing comes after the cursor; the stream stays open
                pass


def test_odd_strings_in_path_and_query_are_not_500(client):
    for path in ("/v1/nodes/%ED%A0%80/health", "/v1/jobs/%00/verdict", "/v1/findings?node=%ED%A0%80", "/v1/hints?job=%FF%FE"):
        r = client.get(path, headers=AUTH)
        assert r.status_code in (200, 404, 422), (path, r.status_code)


# -- SSE framing ------------------------------------------------------------------------------
def _parse_sse(raw: bytes) -> list[dict[str, str]]:
    """A parser as the SSE specification writes it: lines end at CR, LF or CRLF only."""
    events, ev, data = [], {}, []
    for line in re.split(r"\r\n|\r|\n", raw.decode("utf-8")):
        if line == "":
            if data or ev:
                ev["data"] = "\n".join(data)
                events.append(ev)
            ev, data = {}, []
        elif line.startswith(":"):
            continue
        else:
            field, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if field == "data":
                data.append(value)
            else:
                ev[field] = value
    return events


@pytest.mark.parametrize("sep", ["\u2028", "\u2029", "\u0085", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e"])
def test_sse_keeps_json_with_unicode_line_separators_in_one_data_line(sep):
    payload = json.dumps({"reason": f"before{sep}after"}, ensure_ascii=False)
    [ev] = _parse_sse(_sse("hint", payload, 7))
    assert (ev["event"], ev["id"]) == ("hint", "7")
    assert json.loads(ev["data"]) == {"reason": f"before{sep}after"}


def test_sse_embedded_cr_and_crlf_become_separate_data_lines():
    [ev] = _parse_sse(_sse("x", "a\rb\r\nc\nd"))
    assert ev["data"] == "a\nb\nc\nd"


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_sse_round_trips_any_text(text):
    [ev] = _parse_sse(_sse("x", text, 1))
    assert ev["data"] == re.sub(r"\r\n|\r", "\n", text)


def test_hint_reason_with_u2028_reaches_an_event_source_whole(tmp_path):
    """A hint whose reason holds U+2028 and U+0085, through a real server, parsed as a browser does."""
    from gpuvigil.model import Hint, HintAction, FindingKind

    store = HintStore(tmp_path / "h.db")
    hint = Hint(action=HintAction.DRAIN_NODE, ts=1.0, reason="line\u2028sep\u0085nel\rcr", finding_id="f" * 16, finding_kind=FindingKind.ECC, node="n1")
    store.record(now=1.0, new_hints=[hint])
    srv = serve_api_in_thread(create_app(store, TOKEN))
    try:
        raw = b""
        with httpx.stream("GET", f"{srv.url}/v1/hints/stream?after_seq=0", headers=AUTH, timeout=10) as r:
            for chunk in r.iter_raw():
                raw += chunk
                if b"event: hint" in raw and raw.endswith(b"\n\n"):
                    break
        [ev] = [e for e in _parse_sse(raw) if e.get("event") == "hint"]
        assert json.loads(ev["data"])["reason"] == "line\u2028sep\u0085nel\rcr"
    finally:
        srv.stop()
        store.close()


# -- TCP_NODELAY ------------------------------------------------------------------------------
def test_listener_is_tcp_with_nodelay():
    """asyncio sets TCP_NODELAY on accepted connections only when the listener's proto is TCP."""
    sock = bind_socket("127.0.0.1", 0)
    try:
        assert sock.proto == socket.IPPROTO_TCP
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
    finally:
        sock.close()


def test_accepted_connections_have_nodelay(store):
    """Checked on the server side of a real connection: the transport uvicorn serves it on."""
    import os

    seen: list[int] = []
    srv = serve_api_in_thread(create_app(store, TOKEN))
    try:
        with socket.create_connection((srv.host, srv.port)) as client:
            client.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            assert b"200" in client.recv(4096).split(b"\r\n")[0]
            local = client.getsockname()
            # The accepted socket is the server-side peer of `local`: find it among our fds.
            for fd in os.listdir("/proc/self/fd"):
                try:
                    s = socket.socket(fileno=os.dup(int(fd)))
                except OSError:
                    continue
                try:
                    if s.type == socket.SOCK_STREAM and s.getpeername() == local:
                        seen.append(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                except OSError:
                    pass
                finally:
                    s.close()
    finally:
        srv.stop()
    assert seen and all(v != 0 for v in seen)


# -- clocks -----------------------------------------------------------------------------------
def test_simulated_and_wall_clock_times_never_share_a_field(tmp_path):
    """A pipeline on a simulated clock (t = 1000 s) and an ack on the wall clock: each time lands
    in its own, named field."""
    with HintStore(tmp_path / "h.db") as store, TestClient(create_app(store, TOKEN)) as c:
        pipeline_into(store, [[ecc_finding()]], clear_after=1e9).tick(1000.0)
        [h] = c.get("/v1/hints", headers=AUTH).json()["hints"]
        wall_before = time.time()
        acked = c.post(f"/v1/hints/{h['id']}/ack", headers=AUTH, json={"note": "drained"}).json()
        assert (acked["ts"], acked["first_seen"], acked["last_seen"]) == (1000.0, 1000.0, 1000.0)
        assert wall_before - 5 <= acked["state_wall"] <= time.time() + 5
        assert wall_before - 60 <= acked["updated_wall"] <= time.time() + 5
        assert not {"state_ts", "updated_ts"} & set(acked)
        [f] = c.get("/v1/findings", headers=AUTH).json()["findings"]
        assert (f["ts"], f["first_seen"], f["last_seen"]) == (1000.0, 1000.0, 1000.0)
        history = store.hint_history(h["id"])
        assert history[0]["pipeline_ts"] == 1000.0 and history[-1]["pipeline_ts"] is None
        assert all(wall_before - 60 <= e["ts_wall"] <= time.time() + 5 for e in history)


# -- cached reads -----------------------------------------------------------------------------
def test_cached_answers_follow_writes_from_this_and_other_connections(tmp_path):
    """Verdicts and health are cached until the store changes, whoever changes it."""
    path = tmp_path / "h.db"
    with HintStore(path) as store, HintStore(path) as other, TestClient(create_app(store, TOKEN)) as c:
        pipeline_into(store, [[ecc_finding(job="job-1")]], clear_after=1e9).tick(100.0)
        first = c.get("/v1/nodes/node-a/health", headers=AUTH).json()
        assert first == c.get("/v1/nodes/node-a/health", headers=AUTH).json()  # served again, same answer
        h = next(h for h in first["hints"] if h["action"] == "drain_node")
        c.post(f"/v1/hints/{h['id']}/ack", headers=AUTH, json={"note": "drained"})  # this connection
        again = c.get("/v1/nodes/node-a/health", headers=AUTH).json()["hints"]
        assert next(x for x in again if x["id"] == h["id"])["state"] == "acked"
        # Another connection (as `gpuvigil serve` in another process) clears the finding.
        other.record(now=200.0, cleared_findings=[ecc_finding(job="job-1")])
        after = c.get("/v1/nodes/node-a/health", headers=AUTH).json()
        assert (after["status"], after["findings"]) == ("healthy", [])
        assert c.get("/v1/jobs/job-1/verdict", headers=AUTH).json()["status"] == "healthy"


def test_a_full_disk_neither_stops_the_pipeline_nor_loses_hints(tmp_path):
    """SQLite's max_page_count makes writes fail with SQLITE_FULL, as a full disk does."""
    from gpuvigil.model import FindingKind, Hint, HintAction

    with HintStore(tmp_path / "h.db") as store:
        pipeline_into(store, [[ecc_finding()]], clear_after=1e9).tick(100.0)
        pages = store._db.execute("PRAGMA page_count").fetchone()[0]
        store._db.execute(f"PRAGMA max_page_count = {pages}")
        big = [Hint(action=HintAction.AVOID_GPU, ts=1.0, reason="r" * 2000, finding_id=f"{i:016x}", finding_kind=FindingKind.ECC, node=f"n{i}") for i in range(200)]
        result = type("R", (), {"now": 200.0, "active_findings": [], "cleared_findings": [], "new_hints": big, "expired_hints": []})()
        store.on_tick(result)  # does not raise
        assert store.write_failures == 1 and len(store.hints()) < 200
        store._db.execute("PRAGMA max_page_count = 1073741823")  # space again
        empty = type("R", (), {"now": 210.0, "active_findings": [], "cleared_findings": [], "new_hints": [], "expired_hints": []})()
        store.on_tick(empty)
        assert {h.id for h in big} <= {h.id for h in store.hints()}, "the failed tick's hints were written later"
