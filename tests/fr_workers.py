"""Test-only: real multi-rank collective hangs and mismatches with CPU ranks on gloo, each rank
writing its own Flight Recorder dump as torch's dump API returns it.

    python tests/fr_workers.py --world 4 --scenario missing --culprits 1 --out DIR

starts `world` rank processes on 127.0.0.1 (a FileStore in DIR, so no port is needed), runs a
few healthy all_reduces, then the scenario's faulty collective:

- `missing`: the culprit ranks skip it (a rank that hung earlier, or a whole node gone);
- `wrong_op`: the culprit ranks call all_gather (`--op all_gather`) or broadcast instead;
- `size`: the culprit ranks all_reduce a tensor of a different length;
- `dtype`: the culprit ranks all_reduce a float64 tensor instead of float32.

For `missing` and `wrong_op` the healthy ranks wait in the hung collective `--hang-seconds`, then
each rank writes `DIR/fr_rank_<rank>` (pickle bytes from `_dump_fr_trace()`) and, with `--json`,
`DIR/fr_rank_<rank>.json`. For `size` and `dtype` (gloo aborts the process on a size mismatch)
every rank dumps right after enqueueing, the culprits last. All ranks then wait for every rank
to have dumped, so that no rank's exit disturbs another's dump. The ranks are forked from one
launcher that imported torch once; `run_worlds()` runs several worlds in one launcher. Exit code
0 when every rank dumped.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HEALTHY_STEPS = 3


def _rank_main(args: argparse.Namespace) -> int:
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")
    import torch
    import torch.distributed as dist
    from torch._C._distributed_c10d import _dump_fr_trace, _dump_fr_trace_json

    out = Path(args.out)
    rank, world = args.rank, args.world
    culprits = {int(r) for r in args.culprits.split(",") if r != ""}
    dist.init_process_group(
        "gloo",
        init_method=f"file://{out / 'init_store'}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=args.timeout),
    )
    if os.environ.get("FR_WORKERS_TRACE"):
        print(f"rank {rank} init done {time.time():.2f}", flush=True)
    t = torch.ones(1024)
    for _ in range(HEALTHY_STEPS):
        dist.all_reduce(t)
    dist.broadcast(t, src=0)


    def dump() -> None:
        if os.environ.get("FR_WORKERS_TRACE"):
            print(f"rank {rank} dumping {time.time():.2f}", flush=True)
        # Symbolising stack traces costs seconds per rank on a 2-core machine; `--stacks` keeps them.
        (out / f"fr_rank_{rank}").write_bytes(_dump_fr_trace(includeStackTraces=args.stacks))
        if args.json:
            dumped = _dump_fr_trace_json()
            (out / f"fr_rank_{rank}.json").write_text(dumped if isinstance(dumped, str) else dumped.decode())
        (out / f"dumped_{rank}").touch()

    def wait_for_dumps(ranks: set[int]) -> None:
        deadline = time.monotonic() + 60
        while not all((out / f"dumped_{r}").exists() for r in ranks) and time.monotonic() < deadline:
            time.sleep(0.02)

    is_culprit = rank in culprits
    if args.scenario in ("missing", "wrong_op"):
        # A real hang: the healthy ranks wait for the collective until their timeout, then dump.
        work = None
        if args.scenario == "missing":
            if not is_culprit:
                work = dist.all_reduce(t, async_op=True)
        elif is_culprit and args.op == "all_gather":
            work = dist.all_gather([torch.empty_like(t) for _ in range(world)], t, async_op=True)
        elif is_culprit:
            work = dist.broadcast(t, src=0, async_op=True)
        else:
            work = dist.all_reduce(t, async_op=True)
        try:
            if work is not None:
                work.wait(datetime.timedelta(seconds=args.hang_seconds))
        except RuntimeError:
            pass  # the expected outcome: timeout, or a peer closed the connection
        dump()
    else:
        # gloo aborts the whole process (std::terminate) when a peer's message has the wrong
        # size, so every rank dumps right after enqueueing the faulty collective (the Flight
        # Recorder records on enqueue); the culprits enqueue only once the others have dumped.
        if is_culprit:
            wait_for_dumps(set(range(world)) - culprits)
        if args.scenario == "size":
            work = dist.all_reduce(torch.ones(2048) if is_culprit else t, async_op=True)
        elif args.scenario == "dtype":
            # Same element count and byte size, so only the dtype differs.
            work = dist.all_reduce(torch.ones(1024, dtype=torch.int32) if is_culprit else t, async_op=True)
        else:
            raise SystemExit(f"unknown scenario {args.scenario}")
        dump()

    # Wait for every rank to have dumped before exiting: an exiting rank closes its gloo
    # connections, which must not race with another rank still recording its entries.
    wait_for_dumps(set(range(world)))
    if os.environ.get("FR_WORKERS_TRACE"):
        print(f"rank {rank} exiting {time.time():.2f}", flush=True)
    os._exit(0)  # skip gloo's teardown, which can block on peers stuck in the faulty collective


def _launch_world(args: argparse.Namespace) -> str | None:
    import multiprocessing

    Path(args.out).mkdir(parents=True, exist_ok=True)
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_rank_main, args=(argparse.Namespace(**{**vars(args), "rank": r}),)) for r in range(args.world)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=120)
        if proc.is_alive():
            proc.kill()
    if os.environ.get("FR_WORKERS_TRACE"):
        print(f"launcher joined {time.time():.2f}", flush=True)
    missing = [r for r in range(args.world) if not (Path(args.out) / f"fr_rank_{r}").exists()]
    if missing:
        return f"{args.scenario} world={args.world}: ranks {missing} wrote no dump; exit codes {[p.exitcode for p in procs]}"
    return None


def _launch(worlds: list[argparse.Namespace]) -> int:
    """Import torch once, then fork each world's ranks: far cheaper than an interpreter per rank."""
    import torch  # noqa: F401 - imported before forking so that every rank inherits it
    import torch.distributed  # noqa: F401

    failures = [msg for msg in map(_launch_world, worlds) if msg]
    for msg in failures:
        print(msg, file=sys.stderr)
    return 1 if failures else 0


@dataclasses.dataclass
class World:
    out: Path
    world: int
    scenario: str
    culprits: list[int]
    op: str = "all_gather"
    json_form: bool = False
    stacks: bool = False
    timeout: float = 10.0
    hang_seconds: float = 0.5

    def namespace(self) -> argparse.Namespace:
        return argparse.Namespace(
            out=str(self.out), world=self.world, scenario=self.scenario, culprits=",".join(map(str, self.culprits)), op=self.op,
            json=self.json_form, stacks=self.stacks, timeout=self.timeout, hang_seconds=self.hang_seconds, rank=None,
        )


def run_worlds(worlds: list[World]) -> list[list[Path]]:
    """Run the worlds one after another in one fresh launcher process; return each world's dump
    paths in rank order."""
    spec = json.dumps([{**dataclasses.asdict(w), "out": str(w.out)} for w in worlds])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_FR_BUFFER_SIZE": "2000"}
    done = subprocess.run([sys.executable, __file__, "--batch", spec], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"fr_workers failed: {done.stdout.decode(errors='replace')[-1500:]}")
    return [[w.out / f"fr_rank_{r}" for r in range(w.world)] for w in worlds]


def run_world(out: Path, world: int, scenario: str, culprits: list[int], **kw) -> list[Path]:
    return run_worlds([World(out, world, scenario, culprits, **kw)])[0]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--world", type=int)
    p.add_argument("--scenario", choices=["missing", "wrong_op", "size", "dtype"])
    p.add_argument("--culprits", default="")
    p.add_argument("--op", default="all_gather", choices=["all_gather", "broadcast"])
    p.add_argument("--out")
    p.add_argument("--timeout", type=float, default=10.0, help="process group timeout (rendezvous)")
    p.add_argument("--hang-seconds", type=float, default=0.5, help="how long healthy ranks wait in the hung collective")
    p.add_argument("--json", action="store_true")
    p.add_argument("--stacks", action="store_true", help="include Python stack frames in the dumps")
    p.add_argument("--batch", help="internal: a JSON list of worlds to run in turn")
    args = p.parse_args()
    if args.batch:
        return _launch([World(**{**w, "out": Path(w["out"])}).namespace() for w in json.loads(args.batch)])
    if not (args.world and args.scenario and args.out):
        p.error("--world, --scenario and --out are required")
    args.rank = None
    return _launch([args])


if __name__ == "__main__":
    sys.exit(main())
