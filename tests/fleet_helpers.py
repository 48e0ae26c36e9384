"""A real NATS cluster for the fleet tests: Debian's nats-server, N nodes clustered with JetStream
on loopback (free ports, temporary store folders), and a probe client that reads the fleet's
clock and leases from the test."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from benchmarks import natscluster
from services import free_port


def nats_binary() -> str:
    pytest.importorskip("nats", reason="nats-py not installed (pip install 'gpuvigil[fleet]')")
    path = shutil.which("nats-server")
    if not path:
        pytest.skip("nats-server not installed (Debian package nats-server; `make system-deps` installs it)")
    return path


class NatsCluster(natscluster.NatsCluster):
    """The benchmarks' cluster (benchmarks/natscluster.py); the test skips without nats-server or nats-py."""

    def __init__(self, workdir: Path, n: int = 3, mapping: str = ""):
        super().__init__(workdir, n, mapping, exe=nats_binary())


class Probe:
    """A NATS client on its own event loop thread: the fleet's clock as the test sees it (first wall
    time each data time was announced), the lease holders, stream info."""

    def __init__(self, urls: list[str], prefix: str = "gv"):
        self.urls = urls
        self.prefix = prefix
        self.first_wall: list[tuple[float, float]] = []  # (data now, wall monotonic)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.nc: Any = self.call(self._connect())

    def call(self, coro: Any, timeout: float = 30.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _connect(self) -> Any:
        import nats

        nc = await nats.connect(servers=self.urls, max_reconnect_attempts=-1, reconnect_time_wait=0.3, connect_timeout=2)

        async def on(msg: Any) -> None:
            now = float(json.loads(msg.data)["now"])
            if not self.first_wall or now > self.first_wall[-1][0]:
                self.first_wall.append((now, time.monotonic()))

        await nc.subscribe(f"{self.prefix}.clock.>", cb=on)
        return nc

    @property
    def now(self) -> float:
        return self.first_wall[-1][0] if self.first_wall else float("-inf")

    def wall_of(self, data_ts: float) -> float | None:
        """When (wall, monotonic) the fleet's clock first reached `data_ts`."""
        for now, wall in self.first_wall:
            if now >= data_ts:
                return wall
        return None

    def holders(self) -> dict[str, str]:
        async def go() -> dict[str, str]:
            kv = await self.nc.jetstream(timeout=5).key_value(f"{self.prefix}_leases")
            out = {}
            try:
                keys = await kv.keys()
            except Exception:  # noqa: BLE001 - empty bucket
                return out
            for k in keys:
                try:
                    out[k] = (await kv.get(k)).value.decode()
                except Exception:  # noqa: BLE001 - expired meanwhile
                    pass
            return out

        try:
            return self.call(go(), timeout=15)
        except Exception:  # noqa: BLE001 - a failover in progress: ask again later
            return {}

    def publish(self, subject: str, data: bytes, headers: dict[str, str] | None = None) -> None:
        """A core NATS publish, as any client on the bus can send one (forged stamps included)."""

        async def go() -> None:
            await self.nc.publish(subject, data, headers=headers)
            await self.nc.flush()

        self.call(go())

    def stream_leader(self, name: str) -> str:
        """The server name (n<i>) leading a stream's RAFT group (a KV bucket's is KV_<bucket>)."""

        async def go() -> str:
            info = await self.nc.jetstream(timeout=5).stream_info(name)
            return str(info.cluster.leader)

        return self.call(go())

    def stream_replicas(self, name: str) -> int:
        async def go() -> int:
            info = await self.nc.jetstream(timeout=5).stream_info(name)
            return int(info.config.num_replicas or 1)

        return self.call(go())

    def close(self) -> None:
        try:
            self.call(self.nc.close(), timeout=10)
        except Exception:  # noqa: BLE001
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


REPO = Path(__file__).resolve().parents[1]


class GvProc:
    """A `python -m gpuvigil <argv>` process (agent, detect, act) with its output in <name>.log."""

    def __init__(self, name: str, argv: list[str], cwd: Path):
        self.name = name
        self.log = cwd / f"{name}.log"
        self.proc = subprocess.Popen([sys.executable, "-m", "gpuvigil", *argv], cwd=cwd, stdout=self.log.open("ab"), stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def tail(self) -> str:
        return f"--- {self.name} ---\n" + self.text()[-3000:]

    def metrics_url(self) -> str | None:
        """The /metrics URL the process printed at start (None until it has)."""
        m = re.search(r"metrics (http://\S+/metrics)", self.text())
        return m.group(1) if m else None

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


class NatsServer:
    """One nats-server (JetStream) on loopback from a config body the test writes (TLS, accounts):
    `body` gets the listen/http/jetstream lines prepended; `env` holds the variables it names."""

    def __init__(self, workdir: Path, body: str, env: dict[str, str] | None = None, name: str = "nats"):
        exe = nats_binary()
        self.workdir = workdir
        self.port, self.http = free_port(), free_port()
        self.name = name
        conf = workdir / f"{name}.conf"
        conf.write_text(f'listen: 127.0.0.1:{self.port}\nhttp: 127.0.0.1:{self.http}\n'
                        f'jetstream {{ store_dir: "{workdir / (name + "-js")}", max_memory_store: 64MB, max_file_store: 1GB }}\n{body}')
        self.log = workdir / f"{name}.log"
        self.argv = [exe, "-c", str(conf)]
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen(self.argv, stdout=self.log.open("ab"), stderr=subprocess.STDOUT, env=self.env)
        deadline = time.monotonic() + 30
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nats-server exited: {self.log.read_text()[-2000:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.http}/healthz", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"nats-server not healthy: {self.log.read_text()[-2000:]}")
            time.sleep(0.1)

    def url(self, scheme: str = "nats") -> str:
        return f"{scheme}://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None


def make_tls(workdir: Path) -> dict[str, Path]:
    """A throwaway CA, a server certificate for 127.0.0.1/localhost and a client certificate
    (openssl CLI, EC P-256, valid one day)."""
    d = workdir / "tls"
    d.mkdir(exist_ok=True)

    def ssl(*argv: str) -> None:
        subprocess.run(["openssl", *argv], check=True, capture_output=True, cwd=d)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    ssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "1", "-subj", "/CN=gpuvigil test CA")
    for name, ext in (("server", "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth"),
                      ("client", "extendedKeyUsage=clientAuth")):
        (d / f"{name}.ext").write_text(ext + "\n")
        ssl("req", "-new", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN=gpuvigil {name}")
        ssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-days", "1",
            "-out", f"{name}.crt", "-extfile", f"{name}.ext")
    return {n: d / n for n in ("ca.crt", "server.crt", "server.key", "client.crt", "client.key")}
