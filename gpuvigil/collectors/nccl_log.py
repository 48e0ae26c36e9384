"""PyTorch / NCCL training logs: watchdog timeouts, progress of each process group, NCCL warnings
and CUDA out-of-memory errors, in the wordings of several PyTorch and NCCL releases.

Recognised (with or without torchrun's `[rankN]:` prefix and glog `[E1129 23:07:34.44 f.cpp:1]`):

- `[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=6, OpType=ALLREDUCE,
  NumelIn=1048576, NumelOut=1048576, Timeout(ms)=8000) ran for 8031 milliseconds before timing
  out.` — also without NumelIn/NumelOut (torch 1.1x) and without SeqNum (older), and with
  `[PG ID 0 PG GUID 0(default_pg) Rank 0]` or `[PG 1 Rank 0]` prefixes;
- progress: `failure detected by watchdog at work sequence id: 6 PG status: last enqueued work:
  6, last completed work: 5`, `Exception (either an error or timeout) detected by watchdog at
  work: 1580, last enqueued NCCL work: 1582, last completed NCCL work: 1579.`, `Timeout at NCCL
  work: ...`, `Last enqueued NCCL work: 6, last completed NCCL work: 5.`;
- `Some NCCL operations have failed or timed out.` (a timeout without the WorkNCCL line, unless
  an NCCL error in the same log says what failed);
- NCCL errors torch raised: `torch.distributed.DistBackendError: NCCL error in:
  ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1970, unhandled cuda error (run with
  NCCL_DEBUG=INFO for details), NCCL version 2.21.5` (torch 2.x; 1.x raised `RuntimeError`, with
  `torch/lib/c10d/` paths), the watchdog's `Process group watchdog thread terminated with
  exception: NCCL error: remote process exited or there was a network error, NCCL version ...`,
  `NCCL Error 2: unhandled system error`; with the lines after them, `ncclRemoteError: ...`,
  `Last error:` and NCCL's own message, with torchrun's `[rankN]:` or a launcher's `host:`
  prefix;
- `host:pid:tid [dev] file.cc:NN NCCL WARN ...` network and other warnings;
- CUDA OOM, three generations: `CUDA out of memory. Tried to allocate X (GPU 0; Y total capacity;
  Z already allocated; W free; V reserved in total by PyTorch)`; `... GPU 0 has a total capacty
  of ...` (sic, torch 2.1-2.2) and `... total capacity of ... of which ... is free. [Process N has
  X memory in use.] [Including non-PyTorch memory, this process has X memory in use.] Of the
  allocated memory A is allocated by PyTorch, and U is reserved by PyTorch but unallocated.`

ROCm builds say `HIP out of memory` in the same wordings. Each OOM is classified
(`gpuvigil.parsers.oom`, thresholds in `gpuvigil/config/oom_classify.yaml`): `oom_fragmentation`
when PyTorch's reserved but unallocated memory could have held the request had it been contiguous,
`oom_unexplained` when the free memory could have, `oom_foreign_process` when it could have without
the other processes the message lists, else `oom_capacity`.

The line parsing itself (text -> typed records, no I/O) is in `gpuvigil.parsers.nccl` and
`gpuvigil.parsers.oom`; this module turns parsed logs into `events` and tails files. What the
events mean is decided once, by the registered detectors `watchdog` and `nccl_error`
(`gpuvigil.detectors.watchdog`) and `oom_events`, for `serve` and `analyze` alike (`analyze`
builds a whole log's events with `events()` and runs those detectors over them).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import polars as pl

from gpuvigil import schemas
from gpuvigil.collectors.tail import FileTail, TailingLogCollector  # one tail implementation for all logs
from gpuvigil.model import log_source

# The text parsing is shared with `analyze` and the OOM detector; these names stay importable here.
from gpuvigil.parsers.nccl import ParsedLog, Progress, WatchdogTimeout, describe_error, error_cause, looks_like_training_log, parse_lines  # noqa: F401
from gpuvigil.parsers.oom import OomReport, load_oom_config, parse_oom  # noqa: F401


def events(parsed: ParsedLog, *, node: str | None = None, job: str | None = None, file: str | None = None) -> pl.DataFrame:
    """The `events` stream: one row per timeout, progress line, OOM, NCCL error and NCCL warning.
    Rows read from a log file carry it in `source` (`torch:<file>`, model.log_source): a line of
    no known job is still told apart by its file.

    Each message is one the parsers read back whole: a timeout's WorkNCCL line with its rank and
    process group tag (`parsers.nccl.parse_timeout`), a progress line (`nccl_progress`,
    `parse_progress`: which rank had enqueued how far, what names the rank holding the others up),
    an NCCL error (`parse_error_message`), an OOM message (`parsers.oom.parse_oom`)."""
    torch, nccl = log_source("torch", file), log_source("nccl", file)
    rows: list[dict[str, Any]] = []
    for t in parsed.timeouts:
        rows.append({"ts": t.ts, "node": node, "source": torch, "kind": "nccl_timeout", "job": job, "rank": t.rank, "message": t.message()})
    for p in parsed.progress:
        rows.append({"ts": p.ts, "node": node, "source": torch, "kind": "nccl_progress", "job": job, "rank": p.rank, "message": p.message()})
    # A timeout that the log tells only by these lines (no WorkNCCL line) is a timeout all the same.
    for _line, ts, rank in parsed.some_failed:
        rows.append({"ts": ts, "node": node, "source": torch, "kind": "nccl_timeout", "job": job, "rank": rank, "message": "Some NCCL operations have failed or timed out"})
    for _line, ts, rank in parsed.timeout_at:
        rows.append({"ts": ts, "node": node, "source": torch, "kind": "nccl_timeout", "job": job, "rank": rank, "message": "Timeout at NCCL work"})
    for o in parsed.ooms:
        rows.append({"ts": o.ts, "node": node, "gpu": o.gpu, "source": torch, "kind": "oom", "job": job, "rank": o.rank, "message": o.text})
    for e in parsed.errors:
        rows.append({"ts": e.ts, "node": e.host or node, "source": torch, "kind": "nccl_error", "job": job, "rank": e.rank, "message": e.message()})
    for w in parsed.warnings:
        rows.append({"ts": w.ts, "node": w.host or node, "gpu": w.device, "source": nccl, "kind": "nccl_warn", "job": job, "rank": w.rank, "message": w.message})
    return schemas.frame(sorted(rows, key=lambda r: r["ts"]), schemas.EVENTS)


class NcclLogCollector(TailingLogCollector):
    """Tails a training log (one rank's, or torchrun's merged output) and emits `events`."""

    def __init__(self, path: str | Path, *, node: str | None = None, job: str | None = None, from_start: bool = True):
        self.name = f"nccl_log:{path}"
        self.errors = 0
        self.node = node
        self.job = job
        self.path = str(path)
        self.tail = FileTail(Path(path), from_start=from_start)

    def events_from(self, lines: list[str], first_line_no: int) -> pl.DataFrame:
        parsed = parse_lines(lines, reference_ts=time.time(), first_line_no=first_line_no)
        return events(parsed, node=self.node, job=self.job, file=self.path)
