"""Slurm adapter: apply gpuvigil hints with `scontrol`, read cluster state with `squeue`/`sinfo`.

State is read with `--json` (Slurm ≥ 21.08 serializer plugin; 22.05 has it for squeue/sinfo but
not scontrol) and falls back to `scontrol -o show job|node`, which every Slurm has.

Hint → Slurm:

| hint | command |
| --- | --- |
| drain_node / cordon_node | `scontrol update NodeName=N State=DRAIN Reason="gpuvigil <kind> <finding>: ..."` (running jobs keep running: Slurm's drain never kills) |
| requeue_job | `scontrol requeue J` (or `requeuehold` with `params.hold`), then `scontrol update JobId=J ExcNodeList=...` with the hint's exclude_nodes |
| cause cleared (every cause quiet for the hold-down, check passed) | `scontrol update NodeName=N State=RESUME`, only if the node is still drained with *this* finding's reason (an operator's drain is never undone) |
| avoid_gpu, set_alloc_conf, resize_or_move_job, compact | not expressible with scontrol on a running job: nacked with the reason |

Every command runs with a timeout. A command that fails raises `SlurmError` naming the command
and Slurm's message; through `gpuvigil.app.acting.Acting` the hint then stays pending with the error
recorded (`HintStore.record_attempt`), so it is retried and nothing is lost. `plan(hint)` is what
`--act dry-run` prints; `apply(hint)` runs that same plan.

The collector `SlurmStateCollector` maps jobs/nodes/GPU allocations onto gpuvigil's JOBS, NODES
and ALLOCATIONS frames and turns OOM evidence into EVENTS rows (kind `oom`): a job that ended
`OUT_OF_MEMORY`, exited 137, or was killed by signal 9.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import polars as pl
from pydantic import BaseModel, Field

from gpuvigil import config, schemas
from gpuvigil.scheduler.apply import ApplyError, Plan, Step, Unsupported
from gpuvigil.model import Hint, HintAction


class SlurmConfig(BaseModel):
    # A hint whose apply failed is retried after retry_base_seconds, doubling up to retry_max_seconds.
    retry_base_seconds: float = Field(5.0, ge=0)
    retry_max_seconds: float = Field(300.0, ge=0)
    command_timeout_seconds: float = Field(20.0, gt=0)
    reason_prefix: str = Field("gpuvigil", min_length=1)
    max_reason_chars: int = Field(200, ge=40)
    # Map Slurm QOS names onto gpuvigil priority classes; anything else is P2.
    priority_by_qos: dict[str, str] = Field(default_factory=dict)


def slurm_config(cfg: dict[str, Any] | None = None) -> SlurmConfig:
    cfg = config.defaults() if cfg is None else cfg
    return config.section("api.slurm", SlurmConfig, {"api.slurm": cfg.get("api", {}).get("slurm", {})})


class SlurmError(ApplyError):
    """A Slurm command failed, timed out or is missing; the message says which and why."""


class SlurmUnsupported(SlurmError, Unsupported):
    """The hint cannot be expressed with Slurm commands (the hint is nacked with this reason)."""


_NODE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_JOB_ID = re.compile(r"^[0-9]+(_[0-9]+)?$")


def _check_node(node: str | None) -> str:
    # Names go into `NodeName=<node>` arguments; a name with spaces or '=' would smuggle options.
    if not node or not _NODE_NAME.match(node):
        raise SlurmError(f"not a valid Slurm node name: {node!r}")
    return node


def _check_job(job: str | None) -> str:
    if not job or not _JOB_ID.match(job):
        raise SlurmError(f"not a Slurm job id: {job!r} (gpuvigil names Slurm jobs by their numeric id)")
    return job


# -- running commands -------------------------------------------------------------------------
class Slurm:
    """Runs Slurm client commands with a timeout; `env` may carry SLURM_CONF for a test cluster."""

    def __init__(self, *, timeout: float = 20.0, env: Mapping[str, str] | None = None):
        self.timeout = timeout
        self.env = None if env is None else {**os.environ, **env}
        self.calls: deque[list[str]] = deque(maxlen=1000)  # recent commands, in order (for logs and tests)

    def run(self, *argv: str) -> str:
        cmd = list(argv)
        self.calls.append(cmd)
        shown = " ".join(cmd)
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=self.timeout, env=self.env, check=False)
        except FileNotFoundError as exc:
            raise SlurmError(f"`{cmd[0]}` not found: install the Slurm client tools (Debian: slurm-client)") from exc
        except subprocess.TimeoutExpired as exc:
            raise SlurmError(f"`{shown}` timed out after {self.timeout:g}s (is slurmctld reachable?)") from exc
        if proc.returncode != 0:
            msg = (proc.stderr or proc.stdout).strip().splitlines()
            raise SlurmError(f"`{shown}` failed (exit {proc.returncode}): {msg[-1] if msg else 'no message'}")
        return proc.stdout

    def run_json(self, *argv: str) -> dict[str, Any]:
        out = self.run(*argv)
        try:
            data = json.loads(out)
        except json.JSONDecodeError as exc:
            raise SlurmError(f"`{' '.join(argv)}` did not print JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise SlurmError(f"`{' '.join(argv)}` printed JSON that is not an object")
        errors = [e for e in data.get("errors") or [] if e]
        if errors:
            raise SlurmError(f"`{' '.join(argv)}` reported: {errors[0]}")
        return data


# -- parsing ----------------------------------------------------------------------------------
_KEY = re.compile(r"(?:^|\s)([A-Za-z][A-Za-z0-9_:/]*)=")


def parse_scontrol_record(line: str) -> list[tuple[str, str]]:
    """`scontrol -o show ...` one-liner → ordered (key, value) pairs. Values may contain spaces
    (OS=Linux 6.x #1 SMP ...); a node's `Reason=` is always last and taken whole, '=' and all."""
    line = line.strip()
    tail: list[tuple[str, str]] = []
    cut = line.find(" Reason=")
    if line.startswith("NodeName=") and cut >= 0:
        tail = [("Reason", line[cut + len(" Reason=") :].strip())]
        line = line[:cut]
    matches = list(_KEY.finditer(line))
    pairs = []
    for i, m in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(line)
        pairs.append((m.group(1), line[m.end() : end].strip()))
    return pairs + tail


_GRES_COUNT = re.compile(r"(?:^|,)gpu(?::[^:,(]+)?:(\d+)")
_GRES_IDX = re.compile(r"gpu(?::[^:,(]+)?:\d+\(IDX:([0-9,\-]+)\)")
_REASON_STAMP = re.compile(r"\s*\[[^\]]*@[^\]]*\]$")


def gpu_count(gres: str | None) -> int:
    """'gpu:8', 'gpu:h200:8(S:0-1)', 'gres:gpu:2', 'gpu:2(IDX:0-1)' → GPUs; 0 if none."""
    if not gres:
        return 0
    gres = gres.replace("gres:", "").replace("gres/", "")
    return sum(int(m.group(1)) for m in _GRES_COUNT.finditer(gres))


def gpu_indices(gres_detail: str | None) -> list[int]:
    """'gpu:2(IDX:0-1)' or 'gpu:h200:3(IDX:0,2-3)' → [0, 1] / [0, 2, 3]."""
    out: list[int] = []
    for m in _GRES_IDX.finditer(gres_detail or ""):
        for part in m.group(1).split(","):
            lo, _, hi = part.partition("-")
            out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def expand_hostlist(expr: str | None) -> list[str]:
    """Slurm hostlist expression → host names, through python-hostlist (the same grammar as
    Slurm's: several bracket groups per name, `rack[1-2]-gpu[01-02]` → 4 hosts, zero padding,
    comma lists of groups). An expression it cannot parse, or one naming more than its limit of
    hosts (100,000), gives [] rather than wrong names: these names become ExcNodeList entries."""
    if not expr or expr in ("(null)", "None"):
        return []
    import hostlist

    try:
        return [h for h in hostlist.expand_hostlist(expr) if h]
    except (hostlist.BadHostlist, ValueError, RecursionError):
        return []


def _epoch(value: Any) -> float | None:
    if value in (None, "", "Unknown", "None", "N/A", 0, "0"):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, bool):
        return None
    if isinstance(value, dict):  # newer Slurm: {"set": true, "number": N}
        number = value.get("number")
        return float(number) if value.get("set") and isinstance(number, (int, float)) and not isinstance(number, bool) else None
    try:
        return datetime.fromisoformat(str(value)).astimezone().timestamp()
    except ValueError:
        return None


_JOB_STATE = {
    "PENDING": "pending",
    "RUNNING": "running",
    "CONFIGURING": "running",
    "COMPLETING": "running",
    "SUSPENDED": "preempted",
    "PREEMPTED": "preempted",
    "REQUEUED": "requeued",
    "REQUEUE_HOLD": "requeued",
    "REQUEUE_FED": "requeued",
    "RESIZING": "running",
    "COMPLETED": "completed",
}
OOM_EXIT_CODE = 137  # 128 + SIGKILL, what a shell reports for an OOM-killed child


@dataclass
class SlurmJob:
    job: str
    state: str  # Slurm's, e.g. RUNNING, OUT_OF_MEMORY
    user: str | None
    account: str | None
    qos: str | None
    n_gpus: int
    submit_ts: float | None
    start_ts: float | None
    end_ts: float | None
    restarts: int
    excluded_nodes: list[str]
    nodes: list[str]
    batch_host: str | None
    gpus_by_node: list[tuple[str, list[int]]]  # in rank order
    exit_code: int | None  # process exit status (0-255) if it exited
    exit_signal: int | None  # signal number if it was killed
    state_reason: str | None

    @property
    def oom_evidence(self) -> str | None:
        if self.state == "OUT_OF_MEMORY":
            return "job state OUT_OF_MEMORY"
        if self.exit_signal == signal.SIGKILL:
            return "killed by signal 9 (SIGKILL, what the OOM killer sends)"
        if self.exit_code == OOM_EXIT_CODE:
            return f"exit code {OOM_EXIT_CODE} (128 + SIGKILL: a child was OOM-killed)"
        return None


@dataclass
class SlurmNode:
    node: str
    state: str  # base state, lower case: idle | mixed | allocated | down | ...
    flags: list[str]  # upper case: DRAIN, NOT_RESPONDING, ...
    reason: str | None
    n_gpus: int
    gpus_used: int
    features: list[str]
    partitions: list[str]

    @property
    def gpuvigil_state(self) -> str:
        if self.state in ("down", "future", "unknown") or "DOWN" in self.flags:
            return "down"
        if "DRAIN" in self.flags:
            busy = self.state in ("mixed", "allocated", "completing") or "COMPLETING" in self.flags
            return "draining" if busy else "drained"
        return "up"

    @property
    def rack(self) -> str | None:
        for f in self.features:
            if f.startswith("rack"):
                return f
        return None


def _s(value: Any) -> str | None:
    """A string field of Slurm's JSON, or None (a wrong type is treated as absent)."""
    return value if isinstance(value, str) and value else None


def _i(value: Any, default: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        return default
    return int(value)  # ValueError for junk text: the record is dropped


def _job_from_json(j: dict[str, Any]) -> SlurmJob:
    job_id = j["job_id"]
    if isinstance(job_id, bool) or not isinstance(job_id, (int, str)) or not _JOB_ID.match(str(job_id)):
        raise ValueError(f"bad job_id {job_id!r}")
    raw_exit = j.get("exit_code")
    if isinstance(raw_exit, dict):  # newer Slurm: {"status": ..., "return_code": N, "signal": {...}}
        code = raw_exit.get("return_code")
        sig = (raw_exit.get("signal") or {}).get("signal_id")
        exit_code, exit_signal = (code if isinstance(code, int) else None), (sig if isinstance(sig, int) and sig else None)
    elif isinstance(raw_exit, int) and not isinstance(raw_exit, bool):
        # 22.05 prints the raw wait(2) status: low 7 bits = signal, next byte = exit code.
        exit_signal = raw_exit & 0x7F or None
        exit_code = None if exit_signal else (raw_exit >> 8) & 0xFF
    else:
        exit_code = exit_signal = None
    nodes = expand_hostlist(_s(j.get("nodes")))
    resources = j.get("job_resources")
    allocated = resources.get("allocated_nodes") if isinstance(resources, dict) else None
    alloc_nodes = [_s(a.get("nodename")) for a in allocated if isinstance(a, dict) and _s(a.get("nodename"))] if isinstance(allocated, list) else []
    alloc_nodes = alloc_nodes or nodes
    detail = j.get("gres_detail") if isinstance(j.get("gres_detail"), list) else []
    gpus_by_node = [(n, gpu_indices(_s(detail[i]) if i < len(detail) else "")) for i, n in enumerate(alloc_nodes)]
    n_gpus = gpu_count(_s(j.get("tres_per_node"))) * max(_i(j.get("node_count"), 1), 1) or gpu_count(_s(j.get("tres_per_job")))
    state = j.get("job_state")
    if isinstance(state, list):
        state = state[0] if state else None
    return SlurmJob(
        job=str(job_id),
        state=_s(state) or "UNKNOWN",
        user=_s(j.get("user_name")),
        account=_s(j.get("account")),
        qos=_s(j.get("qos")),
        n_gpus=n_gpus,
        submit_ts=_epoch(j.get("submit_time")),
        start_ts=_epoch(j.get("start_time")),
        end_ts=_epoch(j.get("end_time")),
        restarts=_i(j.get("restart_cnt")),
        excluded_nodes=expand_hostlist(_s(j.get("excluded_nodes"))),
        nodes=nodes,
        batch_host=_s(j.get("batch_host")),
        gpus_by_node=gpus_by_node,
        exit_code=exit_code,
        exit_signal=exit_signal,
        state_reason=_s(j.get("state_reason")),
    )


def _job_from_scontrol(pairs: list[tuple[str, str]]) -> SlurmJob:
    kv: dict[str, str] = {}
    gpus_by_node: list[tuple[str, list[int]]] = []
    node_of_detail: str | None = None
    for key, value in pairs:
        kv.setdefault(key, value)
        if key == "Nodes":  # `-d` detail: Nodes=... CPU_IDs=... GRES=gpu:2(IDX:0-1), once per node set
            node_of_detail = value
        elif key == "GRES" and node_of_detail:
            for n in expand_hostlist(node_of_detail):
                gpus_by_node.append((n, gpu_indices(value)))
    code, _, sig = kv.get("ExitCode", "0:0").partition(":")
    exit_signal = int(sig) if sig.isdigit() and int(sig) else None
    nodes = expand_hostlist(kv.get("NodeList"))
    num_nodes_text = kv.get("NumNodes", "1").split("-")[0]  # "1" or a range "1-2" while pending
    num_nodes = int(num_nodes_text) if num_nodes_text.isdigit() else 1

    def none(v: str | None) -> str | None:
        return None if v in (None, "", "(null)", "N/A") else v

    return SlurmJob(
        job=kv["JobId"],
        state=kv.get("JobState", "UNKNOWN"),
        user=none(re.sub(r"\(\d+\)$", "", kv.get("UserId", ""))),
        account=none(kv.get("Account")),
        qos=none(kv.get("QOS")),
        n_gpus=gpu_count(kv.get("TresPerNode")) * num_nodes or gpu_count(kv.get("TresPerJob")),
        submit_ts=_epoch(kv.get("SubmitTime")),
        start_ts=_epoch(kv.get("StartTime")),
        end_ts=_epoch(kv.get("EndTime")),
        restarts=int(kv.get("Restarts", "0") or 0),
        excluded_nodes=expand_hostlist(kv.get("ExcNodeList")),
        nodes=nodes,
        batch_host=none(kv.get("BatchHost")),
        gpus_by_node=gpus_by_node or [(n, []) for n in nodes],
        exit_code=None if exit_signal else int(code) if code.isdigit() else None,
        exit_signal=exit_signal,
        state_reason=none(kv.get("Reason")),
    )


def _node_from_json(n: dict[str, Any]) -> SlurmNode:
    name = _s(n["name"])
    if name is None:
        raise ValueError("node without a name")
    state = n.get("state")
    raw_flags = n.get("state_flags") if isinstance(n.get("state_flags"), list) else []
    flags = [f.upper() for f in raw_flags if isinstance(f, str)]
    if isinstance(state, list):  # newer Slurm: ["IDLE", "DRAIN"]
        flags = [s.upper() for s in state[1:] if isinstance(s, str)] + flags
        state = state[0] if state else None
    partitions = n.get("partitions") if isinstance(n.get("partitions"), list) else []
    return SlurmNode(
        node=name,
        state=(_s(state) or "unknown").lower(),
        flags=flags,
        reason=_s(n.get("reason")),
        n_gpus=gpu_count(_s(n.get("gres"))),
        gpus_used=gpu_count(_s(n.get("gres_used"))),
        features=[f for f in (_s(n.get("features")) or "").split(",") if f],
        partitions=[p for p in partitions if isinstance(p, str)],
    )


def _node_from_scontrol(pairs: list[tuple[str, str]]) -> SlurmNode:
    kv = dict(pairs)
    base, *flags = kv.get("State", "UNKNOWN").split("+")
    base = base.rstrip("*~#!%$@^-")  # state suffix symbols: not responding, powered down, ...
    reason = _REASON_STAMP.sub("", kv.get("Reason", "")) or None
    features = kv.get("AvailableFeatures", "")
    return SlurmNode(
        node=kv["NodeName"],
        state=base.lower(),
        flags=[f.upper() for f in flags],
        reason=reason,
        n_gpus=gpu_count(kv.get("Gres")),
        gpus_used=gpu_count(kv.get("GresUsed")),
        features=[] if features in ("", "(null)") else features.split(","),
        partitions=[p for p in kv.get("Partitions", "").split(",") if p],
    )


# -- reading state ----------------------------------------------------------------------------
_RECORD_ERRORS = (KeyError, ValueError, TypeError, AttributeError, IndexError)


def _parse_each(items: Iterable[Any], parse: Any) -> tuple[list[Any], int]:
    """Parse records one by one: a malformed record is dropped and counted, never fatal."""
    out, dropped = [], 0
    for item in items:
        try:
            out.append(parse(item))
        except _RECORD_ERRORS:
            dropped += 1
    return out, dropped


def _load_json(text: str, what: str) -> dict[str, Any]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SlurmError(f"{what} did not print JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise SlurmError(f"{what} printed JSON that is not an object")
    errors = data.get("errors")
    if isinstance(errors, list) and any(errors):
        raise SlurmError(f"{what} reported: {next(e for e in errors if e)}")
    return data


def parse_squeue_json(text: str) -> tuple[list[SlurmJob], int]:
    """`squeue --json` output → (jobs, records dropped as malformed)."""
    jobs = _load_json(text, "squeue --json").get("jobs")
    return _parse_each(jobs if isinstance(jobs, list) else [], _job_from_json)


def parse_sinfo_json(text: str) -> tuple[list[SlurmNode], int]:
    """`sinfo --json` output → (nodes, one per name: sinfo repeats a node per partition; dropped)."""
    nodes = _load_json(text, "sinfo --json").get("nodes")
    parsed, dropped = _parse_each(nodes if isinstance(nodes, list) else [], _node_from_json)
    return list({n.node: n for n in parsed}.values()), dropped


def parse_scontrol_jobs(text: str) -> tuple[list[SlurmJob], int]:
    """`scontrol -o -d show job` output → (jobs, dropped)."""
    lines = [line for line in text.splitlines() if line.startswith("JobId=")]
    return _parse_each(lines, lambda line: _job_from_scontrol(parse_scontrol_record(line)))


def parse_scontrol_nodes(text: str) -> tuple[list[SlurmNode], int]:
    """`scontrol -o -d show node` output → (nodes, dropped)."""
    lines = [line for line in text.splitlines() if line.startswith("NodeName=")]
    return _parse_each(lines, lambda line: _node_from_scontrol(parse_scontrol_record(line)))


class SlurmState:
    """Reads jobs and nodes, preferring `--json`, else `scontrol -o show`."""

    def __init__(self, slurm: Slurm, *, use_json: bool | None = None):
        self.slurm = slurm
        self.use_json = use_json  # None: try JSON once and remember whether it works
        self.dropped = 0  # malformed records skipped so far

    def _json_ok(self, probe: Sequence[str]) -> bool:
        if self.use_json is None:
            try:
                self.slurm.run_json(*probe)
                self.use_json = True
            except SlurmError as exc:
                if "unrecognized option" not in str(exc) and "invalid option" not in str(exc) and "did not print JSON" not in str(exc):
                    raise
                self.use_json = False
        return self.use_json

    def jobs(self, job: str | None = None) -> list[SlurmJob]:
        """Jobs slurmctld still holds (pending, running, and finished within MinJobAge)."""
        if self._json_ok(["squeue", "--json", "--states=all"]):
            args = ["squeue", "--json", "--states=all"] + (["--jobs", _check_job(job)] if job else [])
            jobs, dropped = parse_squeue_json(self.slurm.run(*args))
        else:
            args = ["scontrol", "-o", "-d", "show", "job"] + ([_check_job(job)] if job else [])
            jobs, dropped = parse_scontrol_jobs(self.slurm.run(*args))
        self.dropped += dropped
        return jobs

    def job(self, job: str) -> SlurmJob:
        found = [j for j in self.jobs(job) if j.job == job]
        if not found:
            raise SlurmError(f"Slurm job {job} not found (finished longer than MinJobAge ago, or never existed)")
        return found[0]

    def nodes(self) -> list[SlurmNode]:
        if self._json_ok(["sinfo", "--json"]):
            nodes, dropped = parse_sinfo_json(self.slurm.run("sinfo", "--json"))
        else:
            nodes, dropped = parse_scontrol_nodes(self.slurm.run("scontrol", "-o", "-d", "show", "node"))
        self.dropped += dropped
        return nodes

    def node(self, node: str) -> SlurmNode:
        _check_node(node)
        found = [n for n in self.nodes() if n.node == node]
        if not found:
            raise SlurmError(f"Slurm node {node} not found")
        return found[0]


class SlurmStateCollector:
    """Publishes Slurm's jobs/nodes/GPU allocations as gpuvigil snapshot streams, and OOM
    evidence of finished jobs as `events` (once per job run)."""

    name = "slurm"
    streams = {"jobs": schemas.JOBS, "nodes": schemas.NODES, "allocations": schemas.ALLOCATIONS, "events": schemas.EVENTS}

    def __init__(self, state: SlurmState, cfg: SlurmConfig | None = None):
        self.state = state
        self.config = cfg or SlurmConfig()
        self.errors = 0
        self.last_error: str | None = None
        self._oom_seen: set[tuple[str, int]] = set()
        self._dropped_seen = 0

    def frames(self, jobs: list[SlurmJob], nodes: list[SlurmNode], now: float) -> dict[str, pl.DataFrame]:
        job_rows = [
            {
                "job": j.job,
                "tenant": j.account or j.user,
                "priority": self.config.priority_by_qos.get(j.qos or "", "P2"),
                "n_gpus": j.n_gpus,
                "state": _JOB_STATE.get(j.state, "pending" if j.state.startswith("PEND") else "failed")
                if not (j.state == "PENDING" and j.restarts)
                else "requeued",
                "submit_ts": j.submit_ts,
                "start_ts": j.start_ts if j.state not in ("PENDING",) else None,
                "restarts": j.restarts,
                "excluded_nodes": ",".join(j.excluded_nodes),
            }
            for j in jobs
        ]
        node_rows = [
            {
                "node": n.node,
                "rack": n.rack,
                "n_gpus": n.n_gpus,
                "state": n.gpuvigil_state,
                "reason": n.reason,
                "free_gpus": max(n.n_gpus - n.gpus_used, 0) if n.gpuvigil_state == "up" else 0,
            }
            for n in nodes
        ]
        alloc_rows = []
        for j in jobs:
            if j.state not in ("RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED"):
                continue
            rank = 0
            for node, gpus in j.gpus_by_node:
                for gpu in gpus:
                    alloc_rows.append({"job": j.job, "rank": rank, "node": node, "gpu": gpu})
                    rank += 1
        event_rows = []
        # Forget runs Slurm no longer lists (older than MinJobAge): they cannot be reported again.
        self._oom_seen &= {(j.job, j.restarts) for j in jobs}
        for j in jobs:
            why = j.oom_evidence
            if why is None or (j.job, j.restarts) in self._oom_seen:
                continue
            self._oom_seen.add((j.job, j.restarts))
            event_rows.append(
                {
                    "ts": j.end_ts or now,
                    "node": j.batch_host or (j.nodes[0] if j.nodes else None),
                    "source": "scheduler",
                    "kind": "oom",
                    "job": j.job,
                    "message": f"slurm job {j.job} ended {j.state}: {why}",
                }
            )
        return {
            "jobs": schemas.frame(job_rows, schemas.JOBS),
            "nodes": schemas.frame(node_rows, schemas.NODES),
            "allocations": schemas.frame(alloc_rows, schemas.ALLOCATIONS),
            "events": schemas.frame(event_rows, schemas.EVENTS),
        }

    def collect(self, now: float) -> dict[str, pl.DataFrame]:
        try:
            jobs, nodes = self.state.jobs(), self.state.nodes()
        except SlurmError as exc:
            # The previous snapshot stays in the window; the error is counted, not raised.
            self.errors += 1
            self.last_error = str(exc)
            return {}
        self.errors += self.state.dropped - self._dropped_seen
        self._dropped_seen = self.state.dropped
        return self.frames(jobs, nodes, now)


# -- applying hints ---------------------------------------------------------------------------
@dataclass
class Applied:
    hint_id: str
    action: str
    detail: str
    outcome: str = "done"  # or "not_ours": an operator's drain, left as it is


class SlurmAdapter:
    """Applies hints to a Slurm cluster: `plan(hint)` says which scontrol commands, `apply(hint)`
    runs that plan. The loop that decides what to apply and when to undo it is
    `gpuvigil.app.acting.Acting` (serve, `gpuvigil act`, and the tests against a real slurmctld)."""

    def __init__(self, slurm: Slurm | None = None, *, store: Any = None, cfg: dict[str, Any] | None = None):
        self.config = slurm_config(cfg)
        self.slurm = slurm or Slurm(timeout=self.config.command_timeout_seconds)
        self.state = SlurmState(self.slurm)
        self.store = store
        self.applied: deque[Applied] = deque(maxlen=1000)  # recent, for logs and tests

    # primitives ------------------------------------------------------------------------------
    def node_reason(self, hint: Hint) -> str:
        verb = "cordon" if hint.action == HintAction.CORDON_NODE else "drain"
        text = f"{self.config.reason_prefix} {verb} {hint.finding_kind.value} {hint.finding_id}: {hint.reason}"
        text = re.sub(r"\s+", " ", "".join(c if c.isprintable() else " " for c in text)).strip()
        return text[: self.config.max_reason_chars]

    def ours(self, reason: str | None) -> bool:
        return bool(reason) and reason.startswith(f"{self.config.reason_prefix} ")  # type: ignore[union-attr]

    def drain_node(self, node: str, reason: str) -> None:
        self.slurm.run("scontrol", "update", f"NodeName={_check_node(node)}", "State=DRAIN", f"Reason={reason}")

    def resume_node(self, node: str) -> None:
        self.slurm.run("scontrol", "update", f"NodeName={_check_node(node)}", "State=RESUME")

    def requeue_job(self, job: str, *, hold: bool = False, exclude_nodes: Iterable[str] = ()) -> str:
        job = _check_job(job)
        current = self.state.job(job)
        steps = []
        if current.state in ("RUNNING", "SUSPENDED", "CONFIGURING"):
            self.slurm.run("scontrol", "requeuehold" if hold else "requeue", job)
            steps.append("requeued" + (" and held" if hold else ""))
        elif current.state == "PENDING":
            if hold:
                self.slurm.run("scontrol", "hold", job)
                steps.append("held")
            steps.append("already pending")
        else:
            raise SlurmError(f"Slurm job {job} is {current.state}: nothing to requeue")
        exclude = sorted(set(current.excluded_nodes) | {_check_node(n) for n in exclude_nodes})
        if exclude and exclude != sorted(current.excluded_nodes):
            # Only a pending job's ExcNodeList can change, hence after the requeue.
            self.slurm.run("scontrol", "update", f"JobId={job}", f"ExcNodeList={','.join(exclude)}")
            steps.append(f"excluding {','.join(exclude)}")
        return f"job {job} " + ", ".join(steps)

    def hold_job(self, job: str) -> None:
        self.slurm.run("scontrol", "hold", _check_job(job))

    def release_job(self, job: str) -> None:
        self.slurm.run("scontrol", "release", _check_job(job))

    def inventory(self) -> dict[str, int]:
        """Node → GPUs, for the circuit breaker's share of the fleet."""
        return {n.node: n.n_gpus for n in self.state.nodes()}

    # hints -------------------------------------------------------------------------------
    def plan(self, hint: Hint) -> Plan:
        """The scontrol commands for this hint; raises SlurmUnsupported if Slurm cannot express
        it, SlurmError for a hint naming no valid node or job."""
        act = hint.action
        if act in (HintAction.DRAIN_NODE, HintAction.CORDON_NODE):
            node = _check_node(hint.node)
            reason = self.node_reason(hint)
            plan = Plan(hint, [])

            def drain() -> str:
                current = self.state.node(node)
                if "DRAIN" in current.flags and not self.ours(current.reason):
                    # An operator's drain stays as it is (and is never resumed by us).
                    plan.outcome = "not_ours"
                    return f"{current.node} already drained by someone else ({current.reason or 'no reason'}): left as is"
                self.drain_node(current.node, reason)
                return f"scontrol drained {current.node}: {reason}"

            plan.steps.append(Step(f'scontrol update NodeName={node} State=DRAIN Reason="{reason}" (unless someone else drained it)', drain))
            return plan
        if act == HintAction.REQUEUE_JOB:
            job = _check_job(hint.job)
            hold = bool(hint.params.get("hold"))
            text = f"scontrol {'requeuehold' if hold else 'requeue'} {job}"
            if hint.exclude_nodes:
                text += f"; scontrol update JobId={job} ExcNodeList={','.join(sorted(_check_node(n) for n in hint.exclude_nodes))}"
            return Plan(hint, [Step(text, lambda: self.requeue_job(job, hold=hold, exclude_nodes=hint.exclude_nodes))])
        raise SlurmUnsupported(
            {
                HintAction.AVOID_GPU: "Slurm cannot take a single GPU of a node out of service with scontrol; drain the node or fix gres.conf",
                HintAction.SET_ALLOC_CONF: "Slurm cannot change a submitted job's environment; resubmit with PYTORCH_CUDA_ALLOC_CONF set",
                HintAction.RESIZE_OR_MOVE_JOB: "Slurm cannot resize a running job's GPUs; resubmit with a larger-memory constraint",
                HintAction.COMPACT: "Slurm has no job migration; compaction needs requeues chosen by an operator",
            }.get(act, f"unsupported hint action {act.value}")
        )

    def apply(self, hint: Hint) -> Applied:
        """Apply one hint (run its plan); raises SlurmError (SlurmUnsupported if Slurm cannot
        express it)."""
        plan = self.plan(hint)
        done = Applied(hint.id, hint.action.value, plan.execute(), plan.outcome)
        self.applied.append(done)
        return done

    def applied_by_us(self, hint: Hint) -> str | None:
        """What the scheduler shows of this hint already applied by gpuvigil (a node drained with
        its finding in the reason), or None."""
        if hint.action not in (HintAction.DRAIN_NODE, HintAction.CORDON_NODE):
            return None
        current = self.state.node(_check_node(hint.node))
        if "DRAIN" in current.flags and self.ours(current.reason) and hint.finding_id in (current.reason or ""):
            return f"{current.node} already drained by gpuvigil: {current.reason}"
        return None

    def undo_plan(self, hint: Hint) -> Plan | None:
        """How to take back what the hint did: resume the node, only while it is still drained
        with gpuvigil's reason for this finding. None for hints that changed no node."""
        if hint.action not in (HintAction.DRAIN_NODE, HintAction.CORDON_NODE) or not hint.node:
            return None
        node = _check_node(hint.node)
        plan = Plan(hint, [])

        def resume() -> str:
            current = self.state.node(node)
            if "DRAIN" not in current.flags:
                plan.outcome = "absent"
                return ""
            if not self.ours(current.reason) or hint.finding_id not in (current.reason or ""):
                plan.outcome = "not_ours"
                return ""
            self.resume_node(node)
            return f"scontrol resumed {node}: cause {hint.finding_id} cleared"

        plan.steps.append(Step(f"scontrol update NodeName={node} State=RESUME (only while drained by gpuvigil for {hint.finding_id})", resume))
        return plan

    def undo(self, hint: Hint) -> str | None:
        """Run `undo_plan`: what was done, None if nothing."""
        plan = self.undo_plan(hint)
        return (plan.execute() or None) if plan is not None else None

    def outcome(self, hint: Hint) -> str:
        return self.apply(hint).detail
