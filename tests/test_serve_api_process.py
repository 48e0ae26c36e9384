"""`gpuvigil serve --api-port` runs the feedback API in a child process (in serve's own
process the API waited for the GIL behind the pipeline, p99 204 ms in the soak). The child gets
the token in its environment, not on its command line; it answers `why` from serve's scheduler;
it dies with serve, even on SIGKILL, so that the next serve can take the port at once; a child
that cannot start is one line from serve."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from gpuvigil.cli.main import build_parser, main
from gpuvigil.app.serve import Server
from services import wait_for

REPO = Path(__file__).resolve().parents[1]
TOKEN = "serve-api-process-token-0123456789"


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def test_the_api_is_another_process_with_the_token_in_its_environment_only(tmp_path):
    (tmp_path / "token").write_text(TOKEN)
    argv = ["serve", "--port", "0", "--scenario", "node_xid79", "--speed", "1000", "--api-port", "0", "--api-token-file", str(tmp_path / "token"),
            "--hint-db", str(tmp_path / "h.db")]
    server = Server(build_parser(argv).parse_args(argv))
    server.start()
    thread = threading.Thread(target=lambda: (setattr(server.args, "duration", 30), server.loop()), daemon=True)
    thread.start()
    try:
        api = server.api_server
        assert api.pid != os.getpid() and api.pid in _children(os.getpid())
        cmdline = Path(f"/proc/{api.pid}/cmdline").read_bytes()
        assert TOKEN.encode() not in cmdline and b" api" in cmdline.replace(b"\0", b" ")
        assert httpx.get(f"{api.url}/v1/hints", timeout=10).status_code == 401
        auth = {"Authorization": f"Bearer {TOKEN}"}
        # The pipeline (this process) writes; the API process reads the same file.
        hints = wait_for(lambda: httpx.get(f"{api.url}/v1/hints", headers=auth, timeout=10).json()["hints"], timeout=60, what="hints in the API")
        hint = next(h for h in hints if h["state"] == "pending")
        assert httpx.post(f"{api.url}/v1/hints/{hint['id']}/ack", headers=auth, json={"note": "cordoned"}, timeout=10).status_code == 200
        assert server.store.get_hint(hint["id"]).state.value == "acked"  # and the ack reaches the pipeline's store
    finally:
        server.stop()
        thread.join(timeout=30)
        server.close()
    assert api.proc.poll() is not None  # closed with serve


def test_a_kill_9_of_serve_takes_the_api_process_with_it(tmp_path):
    (tmp_path / "token").write_text(TOKEN)
    serve = subprocess.Popen(
        [sys.executable, "-m", "gpuvigil", "serve", "--port", "0", "--scenario", "node_xid79", "--speed", "10", "--api-port", "0",
         "--api-token-file", str(tmp_path / "token"), "--hint-db", str(tmp_path / "h.db"), "--log-level", "warning"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    try:
        # serve's start-up line names the API's address (port 0: no race for a free port).
        assert serve.stdout is not None
        line = serve.stdout.readline()
        port = int(re.search(r"feedback API http://127\.0\.0\.1:(\d+)", line).group(1))
        wait_for(lambda: _ok(f"http://127.0.0.1:{port}/healthz"), timeout=120, what="serve's API")
        (child,) = _children(serve.pid)
        serve.send_signal(signal.SIGKILL)
        serve.wait(30)
        wait_for(lambda: not Path(f"/proc/{child}").exists() or "Z" in Path(f"/proc/{child}/stat").read_text().split(")")[1][:3],
                 timeout=30, what="the API process to end")
        # Nothing listens there any more: the next serve can take the port.
        with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait(30)


def _ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.parametrize("problem", ["bad_cert", "port_taken"])
def test_an_api_process_that_cannot_start_is_one_line_from_serve(tmp_path, capsys, monkeypatch, problem):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "token").write_text(TOKEN)
    (tmp_path / "bad.pem").write_text("not a certificate\n")
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    try:
        extra = ["--api-tls-cert", "bad.pem", "--api-tls-key", "bad.pem", "--api-port", "0"] if problem == "bad_cert" else ["--api-port", str(taken.getsockname()[1])]
        assert main(["serve", "--port", "0", "--scenario", "node_xid79", "--duration", "1", "--api-token-file", "token", *extra]) == 2
    finally:
        taken.close()
    err = [line for line in capsys.readouterr().err.strip().splitlines() if line.startswith("gpuvigil")]
    assert err and "the feedback API did not start" in err[-1], err
    assert ("bad.pem" in err[-1]) if problem == "bad_cert" else ("cannot listen" in err[-1]), err

