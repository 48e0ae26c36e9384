"""A NATS JetStream cluster on loopback for the benchmarks and the tests: Debian's nats-server,
`n` nodes clustered (one node: no cluster block), free ports (benchmarks.ports), one store folder,
config and log per node in `workdir`."""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

from benchmarks.ports import free_port


def server_binary() -> str:
    exe = shutil.which("nats-server")
    if exe is None:
        raise RuntimeError("nats-server not installed (Debian package nats-server; `make system-deps` installs it)")
    return exe


class NatsCluster:
    def __init__(self, workdir: Path, n: int = 3, mapping: str = "", *, name: str = "gvtest", max_file_store: str = "2GB", exe: str | None = None):
        exe = exe or server_binary()
        self.workdir = workdir
        self.client_ports = [free_port() for _ in range(n)]
        self.route_ports = [free_port() for _ in range(n)]
        self.http_ports = [free_port() for _ in range(n)]
        self.procs: list[subprocess.Popen | None] = []
        for i in range(n):
            routes = ", ".join(f"nats-route://127.0.0.1:{p}" for j, p in enumerate(self.route_ports) if j != i)
            conf = workdir / f"nats{i}.conf"
            conf.write_text(
                f'server_name: n{i}\nlisten: 127.0.0.1:{self.client_ports[i]}\nhttp: 127.0.0.1:{self.http_ports[i]}\n'
                f'jetstream {{ store_dir: "{workdir / f"js{i}"}", max_memory_store: 64MB, max_file_store: {max_file_store} }}\n'
                + (f"cluster {{ name: {name}, listen: 127.0.0.1:{self.route_ports[i]}, routes: [{routes}] }}\n" if n > 1 else "")
                + f"{mapping}\n"
            )
            log = (workdir / f"nats{i}.log").open("ab")
            self.procs.append(subprocess.Popen([exe, "-c", str(conf)], stdout=log, stderr=subprocess.STDOUT))
        self.urls = [f"nats://127.0.0.1:{p}" for p in self.client_ports]

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Every node answers /healthz (JetStream included: a meta leader was elected)."""
        deadline = time.monotonic() + timeout
        for i, port in enumerate(self.http_ports):
            while True:
                proc = self.procs[i]
                if proc is not None and proc.poll() is not None:
                    raise RuntimeError(f"nats-server n{i} exited: {(self.workdir / f'nats{i}.log').read_text()[-2000:]}")
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1.0) as r:
                        if r.status == 200:
                            break
                except OSError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"nats-server n{i} not healthy after {timeout}s")
                time.sleep(0.2)

    def kill(self, i: int) -> None:
        proc = self.procs[i]
        if proc is not None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
            self.procs[i] = None

    def stop(self) -> None:
        for proc in self.procs:
            if proc is not None and proc.poll() is None:
                proc.terminate()
        for i, proc in enumerate(self.procs):
            if proc is not None:
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)
            self.procs[i] = None
