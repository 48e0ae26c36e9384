"""benchmarks/ports.py: the free loopback ports every test and benchmark server listens on."""

from __future__ import annotations

import socket

from benchmarks.ports import _ephemeral_low, free_port


def test_ports_are_distinct_bindable_and_below_the_ephemeral_range():
    """200 ports in a row: none twice, each below the range the kernel takes source ports of
    outgoing connections from, and each bindable when returned."""
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == 200
    assert all(1024 <= p < _ephemeral_low() for p in ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))


def test_a_port_in_use_is_not_handed_out():
    """A port some process listens on is skipped (its bind fails)."""
    held = []
    try:
        for _ in range(300):
            s = socket.socket()
            s.bind(("127.0.0.1", free_port()))
            s.listen()
            held.append(s)
        taken = {s.getsockname()[1] for s in held}
        assert free_port() not in taken
    finally:
        for s in held:
            s.close()
