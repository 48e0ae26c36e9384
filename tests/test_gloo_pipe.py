"""Checked by behaviour rather than by strings: does torch honour the L1
switches the TaskProlog sets (`deploy/slurm-taskprolog-l1.sh`) on a gloo process group?

Two real gloo ranks (torch's CPU build) run with the Flight Recorder on and every switch set:
`TORCH_NCCL_DEBUG_INFO_PIPE_FILE`, `TORCH_NCCL_DUMP_ON_TIMEOUT`, `TORCH_NCCL_DEBUG_INFO_TEMP_FILE`
and `TORCH_FR_DUMP_TEMP_FILE`. Rank 1 skips a collective, rank 0 times out in it. The Flight
Recorder does record (its own dump API returns the entries), but no rank creates a debug-info
pipe and no dump is written on the timeout: both are ProcessGroupNCCL's watchdog (HeartbeatMonitor)
features. On gloo, gpuvigil's L1 gets dumps only where the job calls the dump API itself; the pipe
and dump-on-timeout need NCCL, i.e. a GPU (none was available to this work: untested there).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

RANK = textwrap.dedent(
    """
    import datetime, os, pickle, sys, time
    import torch, torch.distributed as dist
    from torch._C._distributed_c10d import _dump_fr_trace
    rank, out = int(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=3))
    t = torch.ones(16)
    for _ in range(3):
        dist.all_reduce(t)
    if rank == 0:
        try:
            dist.all_reduce(t)  # rank 1 never joins: times out
            print("no-timeout", flush=True)
        except Exception as exc:
            print("timed-out", type(exc).__name__, flush=True)
        time.sleep(2.0)  # room for a dump on timeout, were there one
        entries = pickle.loads(_dump_fr_trace(includeStackTraces=False)).get("entries", [])
        print("fr-entries", len(entries), flush=True)
        open(f"{out}/done", "w").close()
    else:
        while not os.path.exists(f"{out}/done"):
            time.sleep(0.05)
    """
)


@pytest.mark.torch
def test_gloo_honours_neither_the_debug_info_pipe_nor_dump_on_timeout(tmp_path):
    pytest.importorskip("torch", reason="torch (CPU build) is needed for real gloo ranks")
    env = {
        **os.environ,
        "TORCH_FR_BUFFER_SIZE": "2000",
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(tmp_path / "fr_dump_"),
        "TORCH_FR_DUMP_TEMP_FILE": str(tmp_path / "fr_dump_"),
        "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": str(tmp_path / "fr_pipe_"),
    }
    procs = [subprocess.Popen([sys.executable, "-c", RANK, str(r), str(tmp_path)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    pipes_seen: set[str] = set()
    deadline = time.monotonic() + 240
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        # A rank that honoured the switch would create fr_pipe_<rank>.pipe while it runs.
        pipes_seen |= {e.name for e in tmp_path.iterdir() if "pipe" in e.name}
        time.sleep(0.05)
    outs = [p.communicate(timeout=30) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    out0 = outs[0][0]
    assert "timed-out" in out0, out0
    # The Flight Recorder itself is on (the switches reached torch): 3 healthy + the stuck one.
    assert int(out0.split("fr-entries")[1].split()[0]) >= 4, out0
    assert pipes_seen == set(), pipes_seen
    assert not list(tmp_path.glob("fr_dump_*")), sorted(p.name for p in tmp_path.iterdir())
