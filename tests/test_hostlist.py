"""Slurm hostlist expressions (scheduler/slurm.expand_hostlist, via python-hostlist), on the
forms Slurm's own documentation uses: several bracket groups in one name, and comma lists of
bracketed groups (scontrol(1) "show hostnames", sbatch(1) --nodelist)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuvigil.scheduler.slurm import expand_hostlist


@pytest.mark.parametrize(
    ("expr", "hosts"),
    [
        # Two bracket groups in one name: every combination, in order.
        ("rack[1-2]-gpu[01-02]", ["rack1-gpu01", "rack1-gpu02", "rack2-gpu01", "rack2-gpu02"]),
        ("rack[0-1]_blade[0-1]", ["rack0_blade0", "rack0_blade1", "rack1_blade0", "rack1_blade1"]),
        # Several groups in a comma list (scontrol show hostnames "tux[1-3],linux[01-02]" style).
        ("tux[1-3,5],linux[01-02]", ["tux1", "tux2", "tux3", "tux5", "linux01", "linux02"]),
        ("lx[15,18,32-33]", ["lx15", "lx18", "lx32", "lx33"]),
        ("alpha,beta,gamma", ["alpha", "beta", "gamma"]),
        ("gpu[08-10],login", ["gpu08", "gpu09", "gpu10", "login"]),
        ("r[1,3-4]n", ["r1n", "r3n", "r4n"]),
        ("gv[1-3]", ["gv1", "gv2", "gv3"]),
        ("node-7", ["node-7"]),
        ("(null)", []),
        ("None", []),
        ("", []),
        (None, []),
        # Malformed or absurd: nothing rather than wrong names.
        ("gpu[1-", []),
        ("gpu[3-1]", []),
        ("n[0-99999999]", []),
    ],
)
def test_expand_hostlist(expr, hosts):
    assert expand_hostlist(expr) == hosts


def test_expansion_size_and_padding():
    hosts = expand_hostlist("linux[0-64,128]")
    assert len(hosts) == 66 and hosts[0] == "linux0" and hosts[-1] == "linux128"
    assert expand_hostlist("n[098-101]") == ["n098", "n099", "n100", "n101"]


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="ab01-9[],-_ ", max_size=40))
def test_garbage_never_raises(expr):
    hosts = expand_hostlist(expr)
    assert isinstance(hosts, list) and all(isinstance(h, str) and h for h in hosts)
