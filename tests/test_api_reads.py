"""The feedback API's read path (target: p99 < 50 ms at 20k findings): cached answers per store
version, readers that never wait for a tick being written, and TLS on gpuvigil's own socket."""

from __future__ import annotations

import json
import socket
import ssl
import subprocess
import threading

import httpx
import pytest

from gpuvigil.api.app import create_app, serve_api_in_thread
from gpuvigil.api.store import HintStore
from gpuvigil.errors import UserError
from h_api_helpers import TOKEN, ecc_finding, hang_finding, pipeline_into

AUTH = {"Authorization": f"Bearer {TOKEN}"}
READS = ["/v1/jobs/job-7/verdict", "/v1/nodes/node-a/health", "/v1/findings?limit=10", "/v1/hints", "/v1/findings?job=job-7"]


@pytest.fixture
def store(tmp_path):
    s = HintStore(tmp_path / "hints.db")
    pipeline_into(s, [[ecc_finding(), hang_finding()]], clear_after=1e9).tick(100.0)
    yield s
    s.close()


@pytest.fixture
def server(store):
    srv = serve_api_in_thread(create_app(store, TOKEN))
    yield srv
    srv.stop()


def test_repeated_reads_are_answered_from_the_cache_and_equal_the_route(server):
    cache = server.app.state.read_cache
    with httpx.Client(base_url=server.url, headers=AUTH) as c:
        first = {p: c.get(p) for p in READS}
        assert all(r.status_code == 200 for r in first.values())
        assert len(cache._entries) == len(READS)
        # Make the route unreachable: a second read can only come from the cached bytes.
        store = cache.store
        calls = []
        for name in ("job_summary", "node_summary", "findings_json", "hints_json"):
            original = getattr(store, name)
            setattr(store, name, lambda *a, _o=original, _n=name, **k: calls.append(_n) or _o(*a, **k))
        again = {p: c.get(p) for p in READS}
        assert calls == []
        assert {p: r.content for p, r in again.items()} == {p: r.content for p, r in first.items()}
        assert all(r.headers["content-type"] == "application/json" for r in again.values())


def test_a_write_makes_every_cached_answer_stale(server, store):
    with httpx.Client(base_url=server.url, headers=AUTH) as c:
        before = c.get("/v1/hints").json()
        hint = before["hints"][0]["id"]
        assert c.post(f"/v1/hints/{hint}/ack", json={"note": "drained"}).status_code == 200
        after = c.get("/v1/hints").json()
        assert {h["id"]: h["state"] for h in after["hints"]}[hint] == "acked"
        # A write by another process (its own connection to the file) is seen too.
        with HintStore(store.path) as other:
            other.note(hint, "elsewhere", "written by another process")
        assert {h["id"]: h["state_reason"] for h in c.get("/v1/hints").json()["hints"]}[hint] == "written by another process"


def test_cache_is_behind_auth_and_keyed_by_the_query(server):
    with httpx.Client(base_url=server.url) as c:
        assert c.get("/v1/findings?limit=10", headers=AUTH).status_code == 200
        assert c.get("/v1/findings?limit=10").status_code == 401
        assert c.get("/v1/findings?limit=10", headers={"Authorization": "Bearer wrong-token-wrong-token"}).status_code == 401
        one = c.get("/v1/findings?limit=1", headers=AUTH).json()
        assert one["count"] == 1
        assert c.get("/v1/findings?limit=0", headers=AUTH).status_code == 422
        assert c.get("/v1/nodes/nowhere/health", headers=AUTH).status_code == 404


def test_reads_do_not_wait_for_a_write_in_progress(server, store):
    """A tick holds the writer's connection for its whole transaction; readers use their own
    connections and read the last committed state meanwhile."""
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=10) as c:
        c.get("/v1/hints")
        hint = c.get("/v1/hints").json()["hints"][0]["id"]
        holding = threading.Event()
        release = threading.Event()

        def long_write():
            with store._tx() as db:  # the lock and an open write transaction, as a tick has
                db.execute("UPDATE hints SET state_reason = 'uncommitted' WHERE id = ?", (hint,))
                holding.set()
                release.wait(30)

        writer = threading.Thread(target=long_write)
        writer.start()
        try:
            assert holding.wait(10)
            # Not cached (a new query string), so built from SQLite while the write is open.
            got = c.get("/v1/hints?limit=50")
            assert got.status_code == 200
            assert "uncommitted" not in got.text
            assert c.get("/v1/jobs/job-7/verdict").status_code == 200
        finally:
            release.set()
            writer.join()
        assert {h["id"]: h["state_reason"] for h in c.get("/v1/hints?limit=50").json()["hints"]}[hint] == "uncommitted"


def _self_signed(tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1",
         "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
        check=True, capture_output=True,
    )
    return cert, key


def test_tls_on_gpuvigil_s_own_socket(store, tmp_path):
    cert, key = _self_signed(tmp_path)
    srv = serve_api_in_thread(create_app(store, TOKEN), tls=(str(cert), str(key)))
    try:
        assert srv.url.startswith("https://")
        ctx = ssl.create_default_context(cafile=str(cert))
        with httpx.Client(base_url=srv.url, headers=AUTH, verify=ctx) as c:
            assert c.get("/v1/hints").status_code == 200
            assert c.get("/v1/hints").json()["count"] >= 1
        # Plain HTTP on the TLS port gets nothing useful; TCP_NODELAY is still set.
        assert srv._sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        with pytest.raises(httpx.HTTPError):
            httpx.get(srv.url.replace("https://", "http://") + "/v1/hints", headers=AUTH, timeout=5)
    finally:
        srv.stop()


def test_unreadable_tls_files_are_one_line(store, tmp_path):
    (tmp_path / "bad.pem").write_text("not a certificate")
    with pytest.raises(UserError, match="TLS certificate"):
        serve_api_in_thread(create_app(store, TOKEN), tls=(str(tmp_path / "bad.pem"), str(tmp_path / "bad.pem")))


def test_api_cli_serves_https(tmp_path):
    import os
    import sys

    cert, key = _self_signed(tmp_path)
    HintStore(tmp_path / "h.db").close()
    env = {**os.environ, "GPUVIGIL_API_TOKEN": TOKEN}
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpuvigil", "api", "--db", str(tmp_path / "h.db"), "--port", "0", "--tls-cert", str(cert), "--tls-key", str(key),
         "--log-level", "warning"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        url = json.loads(proc.stdout.readline())["listening"]
        assert url.startswith("https://127.0.0.1:")
        r = httpx.get(url + "/v1/hints", headers=AUTH, verify=ssl.create_default_context(cafile=str(cert)), timeout=10)
        assert r.status_code == 200 and r.json()["count"] == 0
    finally:
        proc.terminate()
        proc.wait(30)
    half = subprocess.run([sys.executable, "-m", "gpuvigil", "api", "--db", str(tmp_path / "h.db"), "--tls-cert", str(cert)],
                          env=env, capture_output=True, text=True)
    assert half.returncode != 0 and "--tls-cert and --tls-key go together" in half.stderr
