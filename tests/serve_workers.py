"""Test-only: a two-rank torch/gloo training job on CPU, run as a Slurm batch job by
tests/test_serve_e2e_slurm.py. Each rank writes its own log (`LOGDIR/<job>/rank<N>.log`: its
stdout/stderr, torch's c10d messages at INFO) and runs the in-process hook with an HttpSink
posting to serve's receiver. After a few steps rank 1 stops calling collectives while its hook
keeps publishing, and rank 0 waits in an all_reduce that never completes: a collective hang
whose culprit is rank 1. On a requeued run (SLURM_RESTART_COUNT > 0) the job trains to the end
and exits 0.

    python tests/serve_workers.py HOOK_URL LOGDIR
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import sys
import time
from pathlib import Path

STEPS = 6
HANG_SECONDS = 90.0  # longer than the test waits: serve's requeue ends it


def rank_main(rank: int, hook_url: str, logdir: Path, store: Path) -> None:
    job = os.environ.get("SLURM_JOB_ID", "local")
    node = os.environ.get("SLURMD_NODENAME", "local")
    restarted = os.environ.get("SLURM_RESTART_COUNT", "0") not in ("", "0")
    log = open(logdir / job / f"rank{rank}.log", "a", buffering=1)  # noqa: SIM115 - the rank's log for its life
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.stdout = sys.stderr = log
    import torch
    import torch.distributed as dist

    import gpuvigil.hook.instrument as gv

    print(f"rank {rank} of job {job} on {node} (restart {os.environ.get('SLURM_RESTART_COUNT', '0')})", flush=True)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=HANG_SECONDS))
    hook = gv.start(job=job, sink=gv.HttpSink(hook_url), rank=rank, node=node, gpu=rank, interval=0.25)
    t = torch.ones(4096)
    for step in range(STEPS):
        dist.all_reduce(t)
        time.sleep(0.2)
        hook.step()
        print(f"step {step} done", flush=True)
    if restarted:
        dist.barrier()
        print("trained to the end", flush=True)
        hook.stop()
        os._exit(0)
    hook.start_background(0.25)
    if rank == 0:
        print(f"all_reduce #{STEPS + 1} enqueued; waiting for rank 1", flush=True)
        try:
            dist.all_reduce(t)
        except RuntimeError as exc:
            print(f"all_reduce failed: {exc}", flush=True)
    else:
        print("rank 1 stops calling collectives (simulated stuck data loader)", flush=True)
        time.sleep(HANG_SECONDS)
    hook.stop()
    os._exit(1)


if __name__ == "__main__":
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "INFO")
    hook_url, logdir = sys.argv[1], Path(sys.argv[2])
    job = os.environ.get("SLURM_JOB_ID", "local")
    (logdir / job).mkdir(parents=True, exist_ok=True)
    store = logdir / job / f"store-{os.environ.get('SLURM_RESTART_COUNT', '0')}"
    store.unlink(missing_ok=True)
    import torch.distributed  # noqa: F401 - once, before forking

    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=rank_main, args=(r, hook_url, logdir, store)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    sys.exit(max(p.exitcode or 0 for p in procs))
