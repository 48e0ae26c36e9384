"""Test-only: two real gloo CPU ranks running the in-process hook (FileSink) while training, then
rank 1 stops calling collectives and rank 0 hangs in an all_reduce, publishing from the hook's
background thread as a hung job would.

    python tests/hook_workers.py OUT_DIR
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import sys
import time
from pathlib import Path

STEPS = 5


def rank_main(rank: int, out: Path) -> None:
    import torch
    import torch.distributed as dist

    import gpuvigil.hook.instrument as gv

    dist.init_process_group("gloo", init_method=f"file://{out / 'store'}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=20))
    hook = gv.start(job="hook-test", sink=gv.FileSink(out / "hook"), rank=rank, node=f"node{rank}", gpu=rank, interval=0.2)
    t = torch.ones(256)
    for _ in range(STEPS):
        dist.all_reduce(t)
        time.sleep(0.05)
        hook.step()
    hook.start_background(0.2)
    if rank == 0:
        work = dist.all_reduce(t, async_op=True)  # rank 1 never joins: collective 6 hangs
        try:
            work.wait(datetime.timedelta(seconds=1.5))
        except RuntimeError:
            pass
    else:
        time.sleep(1.5)
    hook.stop()
    (out / f"done_{rank}").touch()
    while not all((out / f"done_{r}").exists() for r in range(2)):
        time.sleep(0.02)
    os._exit(0)


if __name__ == "__main__":
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")
    import torch.distributed  # noqa: F401 - once, before forking

    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=rank_main, args=(r, out)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    sys.exit(0 if all((out / f"done_{r}").exists() for r in range(2)) else 1)
