"""The hook turns on the collective start records that name a rank stuck inside a kernel
(TORCH_NCCL_ENABLE_TIMING before the process group, torch's runtime switch after it), and says
in each record whether starts are recorded, so that the detector reads a missing start as
unknown, not as "never started". NCCL needs a GPU: its side is played by stand-in torch modules
built from what PyTorch's source does (gpuvigil/hook/instrument.py quotes it); gloo is real."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import types
from pathlib import Path

import pytest

import gpuvigil.hook.instrument as gv

HERE = Path(__file__).parent
STATUS = {"0": {"last_enqueued_collective": "12", "last_started_collective": "11", "last_completed_collective": "10"}}


class Group:
    def __init__(self, switch: bool = True, fails: bool = False):
        self.switched = 0
        if switch:
            self._enable_collectives_timing = self._switch
        self.fails = fails

    def _switch(self):
        if self.fails:  # Backend::enableCollectivesTiming's default
            raise RuntimeError("Backend gloo is missing implementation of enableCollectivesTiming.")
        self.switched += 1


def fake_torch(monkeypatch, *, live: bool, backend: str = "nccl", groups=(), status=STATUS):
    dump = lambda includeCollectives=False, onlyActive=False: json.dumps({"pg_status": status})  # noqa: E731
    c10d = types.SimpleNamespace(_world=types.SimpleNamespace(pg_map={g: (backend, None) for g in groups}))
    dist = types.SimpleNamespace(is_available=lambda: True, is_initialized=lambda: live, get_backend=lambda: backend, distributed_c10d=c10d)
    torch = types.ModuleType("torch")
    torch.distributed, torch._C, torch.cuda = dist, types.SimpleNamespace(_distributed_c10d=types.SimpleNamespace(_dump_fr_trace_json=dump)), None
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setattr(gv, "_late_start_logged", False)
    return torch


@pytest.fixture
def env(monkeypatch):
    for name in (gv.TIMING_ENV, gv.OPT_OUT_ENV, "TORCH_NCCL_DESYNC_DEBUG", "TORCH_DISTRIBUTED_DEBUG"):
        monkeypatch.delenv(name, raising=False)  # restored, set or not, when the test ends
    return monkeypatch


def _record(tmp_path, torch, **kw):
    hook = gv.start("j", tmp_path, rank=0, node="n", gpu=0, **kw)
    torch.distributed.is_initialized = lambda: True  # the job builds its process group after start()
    record = hook.record()
    hook.stop()
    return hook, record


@pytest.mark.parametrize(
    ("setup", "kw", "env_after", "state", "starts", "started"),
    [
        # The documented use: start() at the top of the script, before init_process_group.
        ({"live": False}, {}, "1", "before_group", True, 11),
        # Started after an NCCL group that has the runtime switch: switched on, starts recorded.
        ({"live": True, "groups": "switch"}, {}, "1", "runtime", True, 11),
        # After a group without it: starts unknown (null), and the variable is set for later groups.
        ({"live": True, "groups": "none"}, {}, "1", "too_late", False, None),
        ({"live": True, "groups": "fails"}, {}, "1", "too_late", False, None),
        # Opted out: nothing touched; NCCL without timing records no starts.
        ({"live": False}, {"collective_timing": False}, None, "opted_out", False, None),
        # gloo: timing on or not, no starts (as the real gloo group below shows).
        ({"live": False, "backend": "gloo"}, {}, "1", "before_group", False, None),
    ],
)
def test_start_turns_collective_timing_on_and_records_say_whether_starts_are_known(env, tmp_path, setup, kw, env_after, state, starts, started):
    import os

    setup = dict(setup)
    groups = {"switch": (Group(),), "none": (Group(switch=False),), "fails": (Group(fails=True),)}.get(setup.pop("groups", ""), ())
    torch = fake_torch(env, groups=groups, **setup)
    hook, record = _record(tmp_path, torch, **kw)
    assert (os.environ.get(gv.TIMING_ENV), hook.collective_timing) == (env_after, state)
    assert [g.switched for g in groups] == [1 if state == "runtime" else 0 for _ in groups]
    assert record["collective_starts"] is starts
    assert record["pg_status"]["0"] == {"last_enqueued": 12, "last_started": started, "last_completed": 10, "current_op": None}


def test_the_jobs_own_setting_wins(env, tmp_path):
    import os

    env.setenv(gv.TIMING_ENV, "0")
    hook, record = _record(tmp_path, fake_torch(env, live=False))
    assert (os.environ[gv.TIMING_ENV], hook.collective_timing, record["collective_starts"]) == ("0", "user_off", False)
    # Set on by the job before its groups (or through desync debugging): nothing to switch.
    group = Group()
    env.setenv(gv.TIMING_ENV, "1")
    torch = fake_torch(env, live=True, groups=(group,))
    hook, record = _record(tmp_path, torch)
    assert (hook.collective_timing, group.switched, record["collective_starts"]) == ("before_group", 0, True)
    env.setenv(gv.OPT_OUT_ENV, "0")
    env.delenv(gv.TIMING_ENV)
    env.setenv("TORCH_NCCL_DESYNC_DEBUG", "1")
    hook, record = _record(tmp_path, torch)
    assert (os.environ.get(gv.TIMING_ENV), hook.collective_timing, record["collective_starts"]) == (None, "opted_out", True)


def test_too_late_is_said_once_with_the_fix(env, tmp_path, caplog):
    torch = fake_torch(env, live=True, groups=(Group(switch=False),))
    with caplog.at_level(logging.WARNING, logger="gpuvigil.hook"):
        _record(tmp_path, torch)
        _record(tmp_path, torch)
    [message] = [r.getMessage() for r in caplog.records if r.name == "gpuvigil.hook"]
    assert "Call start() before torch.distributed.init_process_group()" in message and "TORCH_NCCL_ENABLE_TIMING=1" in message
    # On gloo the fix would not help (it records no starts): nothing is said.
    caplog.clear()
    env.delenv(gv.TIMING_ENV)  # (set by the start() above, for the groups built after it)
    torch = fake_torch(env, live=True, backend="gloo", groups=(Group(switch=False),))
    with caplog.at_level(logging.WARNING, logger="gpuvigil.hook"):
        hook, record = _record(tmp_path, torch)
    assert (hook.collective_timing, record["collective_starts"], [r for r in caplog.records if r.name == "gpuvigil.hook"]) == ("too_late", False, [])


def test_a_hook_built_directly_keeps_the_raw_values_where_it_cannot_tell(env, tmp_path):
    """A Hook made without start() on a torch without get_backend: -1 and the value pass as
    the Flight Recorder dumped them, with no collective_starts field."""
    torch = fake_torch(env, live=True)
    del torch.distributed.get_backend
    record = gv.Hook("j", gv.FileSink(tmp_path), rank=0).record()
    assert "collective_starts" not in record and record["pg_status"]["0"]["last_started"] == 11


GLOO = """
import json, os, sys
os.environ["TORCH_FR_BUFFER_SIZE"] = "100"
import torch, torch.distributed as dist
import gpuvigil.hook.instrument as gv
out = {}
for when in ("before", "after"):
    os.environ.pop("TORCH_NCCL_ENABLE_TIMING", None)
    if when == "before":
        hook = gv.start("j", sys.argv[1], rank=0)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if when == "after":
        hook = gv.start("j", sys.argv[1], rank=0)
    t = torch.ones(4)
    for _ in range(3):
        dist.all_reduce(t)
    raw = json.loads(torch._C._distributed_c10d._dump_fr_trace_json(includeCollectives=False))["pg_status"]
    out[when] = {"state": hook.collective_timing, "env": os.environ.get("TORCH_NCCL_ENABLE_TIMING"), "raw": raw, "record": hook.record()["pg_status"],
                 "starts": hook.record().get("collective_starts")}
    hook.stop()
    dist.destroy_process_group()
print(json.dumps(out))
"""


@pytest.mark.torch
def test_a_real_gloo_group_records_no_starts_and_the_hook_says_they_are_unknown(tmp_path):
    """torch 2.13 (CPU), one gloo rank: with TORCH_NCCL_ENABLE_TIMING=1 set by start() before
    the group, and with the runtime switch after it, the Flight Recorder's pg_status keeps
    last_started_collective at -1 while 3 collectives completed. The hook sends null."""
    pytest.importorskip("torch", reason="torch (CPU build) is needed for a real gloo group")
    done = subprocess.run([sys.executable, "-c", GLOO, str(tmp_path)], capture_output=True, text=True, timeout=120,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE.parent)})
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.splitlines()[-1])
    assert (out["before"]["state"], out["after"]["state"]) == ("before_group", "runtime")
    assert out["before"]["env"] == out["after"]["env"] == "1"
    for when in ("before", "after"):
        # (The Flight Recorder keeps the first, destroyed group's status beside the second's.)
        last = max(out[when]["raw"], key=int)
        pg, rec = out[when]["raw"][last], out[when]["record"][last]
        assert (pg["last_enqueued_collective"], pg["last_started_collective"], pg["last_completed_collective"]) == ("3", "-1", "3")
        assert (rec["last_enqueued"], rec["last_started"], rec["last_completed"], out[when]["starts"]) == (3, None, 3, False)
