"""Free loopback ports for the servers the benchmarks and the tests start (nats-server,
Alertmanager, Prometheus, Slurm, the API).

A port is chosen *below* the kernel's ephemeral range and never handed out twice in a process:
a port the kernel gives for `bind(("127.0.0.1", 0))` comes from the range it also uses for the
source end of outgoing connections, so a NATS route dialling a peer can take it before our
server listens on it (CI failed once so: "bind: address already in use").
"""

from __future__ import annotations

import os
import random
import socket
import time
from pathlib import Path

_HANDED_OUT: set[int] = set()


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A loopback port that is bindable now and that no earlier call returned."""
    low = _ephemeral_low()
    floor = max(1024, low - 12000)
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    for _ in range(500):
        port = rng.randrange(floor, low)
        if port in _HANDED_OUT:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError(f"no free loopback port in {floor}..{low - 1}")
