"""The feedback API of `gpuvigil serve` in a process of its own.

In one process the API shares the GIL with the pipeline: while a tick runs Python (detectors,
the store write), a request waits for it, and the soak measured an API p99 of 204 ms inside
`serve` against 8-25 ms for `gpuvigil api` alone. So `serve --api-port` starts
`gpuvigil api` as a child on the same hint store file (SQLite, WAL: the child reads what the
pipeline commits and writes acks/nacks the pipeline reads).

- The bearer token goes to the child in its environment, never on its command line (`ps`).
- The child ends with `serve`: Linux's parent-death signal (SIGKILL, so that a `kill -9` of
  serve frees the port for the next start at once), and a watch on its parent's pid elsewhere.
- `GET /v1/jobs/{job}/why` needs the built-in scheduler, which lives in `serve`: the child asks
  it over a Unix socket in a private folder (multiprocessing.connection, HMAC-authenticated
  with a random key the child gets in its environment; JSON bytes only, never pickles).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path
from typing import Any

from gpuvigil.api.auth import TOKEN_ENV
from gpuvigil.errors import UserError

WHY_KEY_ENV = "GPUVIGIL_WHY_KEY"
_MAX_MESSAGE = 16 << 20  # a why answer is a few KB; a job name far less


def _die_with_parent() -> None:
    """In the child: SIGKILL when the parent dies (Linux prctl PR_SET_PDEATHSIG). Set by the child
    itself at start, not as a preexec_fn: `serve` has threads by then, and a preexec_fn runs
    between fork and exec, where a lock another thread held can deadlock the child."""
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1


def watch_parent(parent_pid: int, interval: float = 1.0) -> None:
    """In the child: die with the parent (parent-death signal where Linux has it), and exit when
    the parent is gone in any case (it may have died before the signal was set up)."""
    _die_with_parent()
    if os.getppid() != parent_pid:
        os._exit(0)

    def loop() -> None:
        while True:
            time.sleep(interval)
            if os.getppid() != parent_pid:
                os._exit(0)

    threading.Thread(target=loop, name="gpuvigil-api-parent-watch", daemon=True).start()


class WhyServer:
    """In `serve`: answers the child's why questions with `why(job)` (a JSON-able dict or None)."""

    def __init__(self, why: Callable[[str], Any]):
        self.why = why
        self.key = secrets.token_bytes(32)
        self._dir = tempfile.mkdtemp(prefix="gpuvigil-why-")  # mode 0700: only this user
        self.address = str(Path(self._dir) / "why.sock")
        self._listener = Listener(self.address, family="AF_UNIX", authkey=self.key)
        self._closed = False
        threading.Thread(target=self._accept, name="gpuvigil-why", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn = self._listener.accept()
            except Exception:  # noqa: BLE001 - a failed handshake or a closed listener
                if self._closed:
                    return
                continue
            threading.Thread(target=self._answer, args=(conn,), name="gpuvigil-why-conn", daemon=True).start()

    def _answer(self, conn: Connection) -> None:
        with conn:
            while True:
                try:
                    job = conn.recv_bytes(4096).decode("utf-8", "replace")
                except (EOFError, OSError):
                    return
                try:
                    reply = json.dumps({"ok": True, "why": self.why(job)})
                except Exception as exc:  # noqa: BLE001 - the answer says why, the connection lives on
                    reply = json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
                try:
                    conn.send_bytes(reply.encode())
                except OSError:
                    return

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        shutil.rmtree(self._dir, ignore_errors=True)


class WhyClient:
    """In the API child: the `why` provider of `create_app`, asking `serve` over the socket."""

    def __init__(self, address: str, key: bytes):
        self.address, self.key = address, key
        self._conn: Connection | None = None
        self._lock = threading.Lock()

    def __call__(self, job: str) -> dict[str, Any] | None:
        from fastapi import HTTPException

        with self._lock:
            for attempt in range(2):  # one reconnect: serve may have dropped the connection
                try:
                    if self._conn is None:
                        self._conn = Client(self.address, family="AF_UNIX", authkey=self.key)
                    self._conn.send_bytes(job.encode("utf-8", "replace"))
                    got = json.loads(self._conn.recv_bytes(_MAX_MESSAGE))
                    break
                except (OSError, EOFError, ValueError) as exc:
                    if self._conn is not None:
                        self._conn.close()
                    self._conn = None
                    if attempt:
                        raise HTTPException(503, f"the scheduler behind this API does not answer ({type(exc).__name__})") from None
        if not got.get("ok"):
            raise HTTPException(503, f"the scheduler could not answer: {got.get('error', '')[:300]}")
        return got.get("why")


class ApiProcess:
    """`gpuvigil api` as a child of `serve`: `.url`, `.port`, `.pid`, `.stop()`."""

    def __init__(
        self,
        db: str | Path,
        host: str,
        port: int,
        *,
        token: str | None,
        insecure_local: bool,
        config: str | Path | None = None,
        tls: tuple[str, str] | None = None,
        why: Callable[[str], Any] | None = None,
        log_level: str = "warning",
        startup_timeout: float = 60.0,
    ):
        self.why_server = WhyServer(why) if why is not None else None
        cmd = [sys.executable, "-m", "gpuvigil", "api", "--db", str(db), "--host", host, "--port", str(port), "--log-level", log_level,
               "--parent-pid", str(os.getpid())]
        env = {k: v for k, v in os.environ.items() if k not in (TOKEN_ENV, WHY_KEY_ENV)}
        if token is not None:
            env[TOKEN_ENV] = token
        elif insecure_local:
            cmd.append("--insecure-local")
        if config is not None:
            cmd += ["--config", str(config)]
        if tls is not None:
            cmd += ["--tls-cert", tls[0], "--tls-key", tls[1]]
        if self.why_server is not None:
            cmd += ["--why-socket", self.why_server.address]
            env[WHY_KEY_ENV] = self.why_server.key.hex()
        self._stderr_tail: list[str] = []
        try:
            self.proc = subprocess.Popen(
                cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            )
        except OSError as exc:
            self._close_why()
            raise UserError(f"cannot start the feedback API process: {exc}") from exc
        threading.Thread(target=self._relay_stderr, name="gpuvigil-api-stderr", daemon=True).start()
        line = self._first_line(startup_timeout)
        try:
            listening = json.loads(line)["listening"]
        except (ValueError, KeyError, TypeError):
            self.stop()
            why_not = (self._stderr_tail[-1] if self._stderr_tail else "").removeprefix("gpuvigil: ").strip()
            raise UserError(f"the feedback API did not start: {why_not or 'no reason given (see the log)'}") from None
        threading.Thread(target=self._drain_stdout, name="gpuvigil-api-stdout", daemon=True).start()
        self.url = listening
        self.port = int(listening.rsplit(":", 1)[1])
        self.pid = self.proc.pid

    def _first_line(self, timeout: float) -> str:
        got: list[str] = []
        reader = threading.Thread(target=lambda: got.append(self.proc.stdout.readline() if self.proc.stdout else ""), daemon=True)
        reader.start()
        reader.join(timeout)
        return got[0] if got else ""

    def _relay_stderr(self) -> None:
        # The child's log lines go to serve's stderr; the last few say why a failed start failed.
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            sys.stderr.write(line)
            self._stderr_tail = [*self._stderr_tail[-19:], line.rstrip("\n")]

    def _drain_stdout(self) -> None:
        assert self.proc.stdout is not None
        for _ in self.proc.stdout:
            pass

    def _close_why(self) -> None:
        if self.why_server is not None:
            self.why_server.close()

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)
        self._close_why()
