"""Test-only: real multi-rank training loops on CPU (torch + gloo) with the in-process hook
(`gpuvigil.hook.instrument`, FileSink) publishing from its background thread, and each rank's Flight
Recorder dump written at the end. Three faults, each a real run of real processes:

- `hang`: after the healthy steps, rank `culprit` stops calling collectives (stuck in its own
  code) while its peers block in the next all_reduce for `hang_seconds`;
- `slow`: rank `culprit` computes `slowdown` times longer every step; everybody keeps training,
  so its peers wait for it inside every all_reduce;
- `dead`: rank `culprit` dies (its process exits) after the healthy steps, without entering the
  next collective; its peers block in it and the dead rank's hook falls silent.

    python tests/rank_workers.py OUT_DIR  (runs the worlds given as JSON on stdin)

Ranks are forked from one launcher that imported torch once. Each world writes
`OUT/<scenario>/hook/*.jsonl` (the hook's records) and `OUT/<scenario>/fr_rank_<r>` (pickle bytes
from `_dump_fr_trace()`), plus `OUT/<scenario>/wall.json` (when the fault began, wall clock).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path


@dataclasses.dataclass
class World:
    scenario: str  # hang | slow | dead
    world: int = 4
    culprit: int = 2
    steps: int = 30  # healthy steps first (slow: all steps)
    compute_seconds: float = 0.03
    slowdown: float = 2.0
    hang_seconds: float = 4.0
    interval: float = 0.1  # hook publishing period


def _rank_main(w: World, rank: int, out: Path) -> None:
    import torch
    import torch.distributed as dist
    from torch._C._distributed_c10d import _dump_fr_trace

    import gpuvigil.hook.instrument as gv

    dist.init_process_group("gloo", init_method=f"file://{out / 'store'}", rank=rank, world_size=w.world, timeout=datetime.timedelta(seconds=30))
    hook = gv.start(job=f"real-{w.scenario}", sink=gv.FileSink(out / "hook"), rank=rank, node=f"node{rank // 2}", gpu=rank % 2, interval=w.interval)
    hook.start_background(w.interval)
    t = torch.ones(4096)
    is_culprit = rank == w.culprit

    def step(compute: float) -> None:
        time.sleep(compute)  # the rank's forward/backward
        dist.all_reduce(t)  # gradients
        hook.step()

    for _ in range(w.steps):
        step(w.compute_seconds * (w.slowdown if w.scenario == "slow" and is_culprit else 1.0))
    if rank == 0:
        (out / "wall.json").write_text(json.dumps({"fault_ts": time.time()}))
    if w.scenario in ("hang", "dead"):
        if is_culprit and w.scenario == "dead":
            hook._stop.set()  # the process dies: its hook thread dies with it, nothing more is published
            (out / f"fr_rank_{rank}").write_bytes(_dump_fr_trace(includeStackTraces=False))
            (out / f"done_{rank}").touch()
            os._exit(1)
        if is_culprit:
            time.sleep(w.hang_seconds)  # stuck outside collectives (a deadlock in its own code)
        else:
            work = dist.all_reduce(t, async_op=True)  # never joined by the culprit
            try:
                work.wait(datetime.timedelta(seconds=w.hang_seconds))
            except RuntimeError:
                pass  # timeout, or the dead peer's connection closed
            if w.scenario == "dead":
                time.sleep(max(0.0, w.hang_seconds - 1.0))  # still hung, still publishing
    hook.stop()
    (out / f"fr_rank_{rank}").write_bytes(_dump_fr_trace(includeStackTraces=False))
    (out / f"done_{rank}").touch()
    deadline = time.monotonic() + 60
    while not all((out / f"done_{r}").exists() for r in range(w.world)) and time.monotonic() < deadline:
        time.sleep(0.02)
    os._exit(0)  # skip gloo's teardown, which can block on a peer stuck in the faulty collective


def _launch(worlds: list[World], root: Path) -> int:
    import multiprocessing

    import torch  # noqa: F401 - imported before forking so that every rank inherits it
    import torch.distributed  # noqa: F401

    ctx = multiprocessing.get_context("fork")
    failures = []
    for w in worlds:
        out = root / w.scenario
        out.mkdir(parents=True, exist_ok=True)
        procs = [ctx.Process(target=_rank_main, args=(w, r, out)) for r in range(w.world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=120)
            if p.is_alive():
                p.kill()
        missing = [r for r in range(w.world) if not (out / f"fr_rank_{r}").exists()]
        if missing:
            failures.append(f"{w.scenario}: ranks {missing} wrote no dump; exit codes {[p.exitcode for p in procs]}")
    for msg in failures:
        print(msg, file=sys.stderr)
    return 1 if failures else 0


def run_worlds(root: Path, worlds: list[World]) -> dict[str, Path]:
    """Run the worlds one after another in one fresh launcher; return each world's folder."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_FR_BUFFER_SIZE": "2000"}
    spec = json.dumps([dataclasses.asdict(w) for w in worlds])
    done = subprocess.run([sys.executable, __file__, str(root)], input=spec.encode(), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"rank_workers failed: {done.stdout.decode(errors='replace')[-1500:]}")
    return {w.scenario: root / w.scenario for w in worlds}


if __name__ == "__main__":
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")
    sys.exit(_launch([World(**w) for w in json.loads(sys.stdin.read())], Path(sys.argv[1])))
