"""The remediation ladder and the return-to-service check: the `Steps` of the quarantine state
machine (gpuvigil/scheduler/quarantine.py) when `remediation.enabled` is on.

A record gpuvigil holds out reaches `remediating` once every cause is quiet. `Ladder.remediate`
then climbs one rung per call, each a configured command with a timeout whose outcome (exit code,
seconds, the tail of its output, timed out or not) is recorded on the record
(``steps["ladder"]["runs"]``) and so in its transitions:

1. **GPU reset**, only where the XID table says a reset suffices for every cause (NVIDIA's
   RESET_GPU action), the GPU is known, and the processes command shows nothing holding it;
2. **reboot**, through the scheduler: the node is drained first (the drain waits until no job is
   left on it), then the reboot command runs; where the scheduler cannot drain it (no drainer and
   gpuvigil only cordoned it), the rung is skipped;
3. **RMA**: the record leaves for the RMA state with an evidence bundle.

A rung's command is recorded as running before it starts: gpuvigil restarted while it ran never
runs it again (NVSentinel's unwanted reboots after a restart); the check says whether it worked.
A rung that passes moves the record to `verifying`; `Ladder.verify` runs the check command (by
default `gpuvigil preflight`, pass = its PASS or WARN exit code) and only a pass returns the
node. A failed check sends the record back to remediating, where the next rung runs: a quiet
cause never returns a node by itself.

Lemon rule: a node or GPU remediated `lemon.remediations` times within `lemon.window_seconds`
(counted from the transition log, across episodes and restarts) goes to RMA instead of another
try. So does one held out by a finding of a kind in `rma_kinds` (a failed row remap: NVIDIA's RMA
criterion, which no reset or reboot repairs), before any rung. Every RMA writes a tarball (`bundle.dir`): the record and its transitions, the node's
findings with their evidence, the XID/ECC/row-remap history among them and the ECC command's
output, the node's kernel-log excerpt, and `nvidia-bug-report.sh` output where that program
exists; `manifest.json` says what is in it and what could not be had.

Placeholders in every command's arguments: ``{node}``, ``{gpu}`` (empty for a whole node) and
``{out}`` (a file path the command may write, e.g. the bug report).
"""

from __future__ import annotations

import io
import json
import re
import shutil
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from gpuvigil import config
from gpuvigil.gpu import xid as xid_table
from gpuvigil.kinds import FindingKind
from gpuvigil.scheduler.quarantine import QuarantineMachine, Record, StepResult

OUTPUT_TAIL_CHARS = 2000


class Command(BaseModel):
    model_config = ConfigDict(extra="forbid")

    command: list[str] | None = None  # null: the rung (or bundle part) is not configured
    timeout_seconds: float = Field(120.0, gt=0)


class VerifyCommand(Command):
    # `gpuvigil preflight` exits 0 PASS, 1 WARN, 2 FAIL, 3 cannot check: PASS and WARN return a node.
    pass_exit_codes: list[int] = Field(default_factory=lambda: [0, 1])


class LemonConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    remediations: int = Field(5, ge=1)
    window_seconds: float = Field(7 * 86400.0, gt=0)


class BundleConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    dir: str = "/var/lib/gpuvigil/rma"
    kernel_log: Command = Command(command=["journalctl", "-k", "--no-pager", "-o", "short-iso", "-n", "20000"], timeout_seconds=60)
    kernel_log_pattern: str = r"NVRM|Xid|nvidia|NVLink|GPU"
    kernel_log_max_lines: int = Field(5000, ge=1)
    ecc: Command = Command(command=["nvidia-smi", "-q", "-d", "ECC,ROW_REMAPPER,PAGE_RETIREMENT"], timeout_seconds=60)
    bug_report: Command = Command(command=["nvidia-bug-report.sh", "--output-file", "{out}"], timeout_seconds=900)


class RemediationConfig(BaseModel):
    """The `remediation` config section."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = False
    gpu_reset: Command = Command(command=["nvidia-smi", "--gpu-reset", "-i", "{gpu}"], timeout_seconds=120)
    gpu_processes: Command = Command(command=["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader", "-i", "{gpu}"], timeout_seconds=30)
    reboot: Command = Command(command=None, timeout_seconds=1800)
    verify: VerifyCommand = VerifyCommand(command=["gpuvigil", "preflight"], timeout_seconds=900)
    lemon: LemonConfig = LemonConfig()
    # Finding kinds no rung repairs: a record held out by one goes to RMA at once.
    rma_kinds: list[FindingKind] = Field(default_factory=lambda: [FindingKind.ROW_REMAP_FAILURE])
    bundle: BundleConfig = BundleConfig()


def remediation_config(cfg: dict[str, Any] | None = None) -> RemediationConfig:
    return config.section("remediation", RemediationConfig, config.defaults() if cfg is None else cfg)


RUNGS = ("gpu_reset", "reboot")


def run_command(cmd: Command, **values: Any) -> dict[str, Any]:
    """Run one configured command (placeholders filled in) with its timeout; its outcome."""
    argv = []
    for arg in cmd.command or []:
        for k, v in values.items():  # only the known placeholders: an awk script's braces stay as they are
            arg = arg.replace("{" + k + "}", "" if v is None else str(v))
        argv.append(arg)
    out: dict[str, Any] = {"argv": argv, "started": time.time()}
    t0 = time.monotonic()
    try:
        p = subprocess.run(argv, capture_output=True, timeout=cmd.timeout_seconds, stdin=subprocess.DEVNULL)
        out.update(rc=p.returncode, timed_out=False, stdout=p.stdout.decode("utf-8", "replace"), stderr=p.stderr.decode("utf-8", "replace"))
    except subprocess.TimeoutExpired as exc:
        out.update(rc=None, timed_out=True, stdout=(exc.stdout or b"").decode("utf-8", "replace"), stderr=(exc.stderr or b"").decode("utf-8", "replace"))
    except OSError as exc:  # not installed, not executable
        out.update(rc=None, timed_out=False, stdout="", stderr=f"cannot run {argv[0] if argv else '(empty command)'}: {exc.strerror or exc}")
    out["seconds"] = round(time.monotonic() - t0, 3)
    return out


def _outcome(run: dict[str, Any], ok_codes: tuple[int, ...] | list[int] = (0,)) -> tuple[bool, str]:
    tail = (run["stderr"].strip() or run["stdout"].strip())[-300:]
    if run["timed_out"]:
        return False, f"timed out after {run['seconds']:.0f} s"
    if run["rc"] is None:
        return False, tail
    ok = run["rc"] in ok_codes
    return ok, f"exit {run['rc']}" + (f": {tail}" if tail else "")


def _kept(run: dict[str, Any]) -> dict[str, Any]:
    """What the record keeps of a run: the output's tail, not all of it."""
    return {**{k: v for k, v in run.items() if k not in ("stdout", "stderr")}, "output_tail": (run["stdout"] + run["stderr"])[-OUTPUT_TAIL_CHARS:]}


class Ladder:
    """The `Steps` of the quarantine machine: see the module docstring.

    `findings_of(node)` gives the node's findings as JSON dicts (the hint store's, cleared ones
    included); `scheduler` drains a node for a reboot: any object with `drain_for_reboot(node,
    reason) -> str` and `drained(node) -> bool` (`SlurmDrainer` for Slurm)."""

    def __init__(self, cfg: RemediationConfig, machine: QuarantineMachine, *, findings_of: Callable[[str], list[dict[str, Any]]] | None = None,
                 scheduler: Any = None):
        self.cfg = cfg
        self.machine = machine
        self.findings_of = findings_of or (lambda node: [])
        self.scheduler = scheduler

    # -- Steps ---------------------------------------------------------------------------------
    def remediate(self, record: Record, now: float) -> StepResult:
        lad = record.steps.setdefault("ladder", {"next": 0, "runs": []})
        started = lad.pop("running", None)
        if started is not None:
            # gpuvigil stopped while this rung's command ran: never run again (a second reboot is
            # worse than none); whether it worked is for the check to say.
            detail = f"{started['rung']}: gpuvigil stopped while it ran (started {started['ts']:.0f}); not run again, the check decides"
            lad["runs"].append({"rung": started["rung"], "ts": now, "outcome": "unknown", "detail": detail})
            self.machine.save(record)
            return StepResult("passed", detail, {"rung": started["rung"], "rc": None})
        done = self.remediations(record, now)
        if done >= self.cfg.lemon.remediations:
            why = f"lemon: {done} remediations within {self.cfg.lemon.window_seconds / 86400:g} days (limit {self.cfg.lemon.remediations})"
            return self._rma(record, now, why)
        beyond = sorted({c.kind for c in record.causes.values() if c.kind in self.cfg.rma_kinds})
        if beyond:
            return self._rma(record, now, f"{', '.join(beyond)}: no reset or reboot repairs it (remediation.rma_kinds)")
        while lad["next"] < len(RUNGS):
            rung = RUNGS[lad["next"]]
            skip = self._skip(record, rung)
            if skip:
                lad["runs"].append({"rung": rung, "ts": now, "outcome": "skipped", "detail": skip})
                lad["next"] += 1
                continue
            if rung == "reboot" and self.scheduler is not None and not self.scheduler.drained(record.node):
                if not lad.get("drain_asked"):
                    lad["drain_asked"] = self.scheduler.drain_for_reboot(record.node, f"gpuvigil remediation: reboot of {record.node} after it is drained")
                self.machine.save(record)
                return StepResult("pending", f"reboot waits for {record.node} to drain")
            cmd: Command = getattr(self.cfg, rung)
            # Intent first: a restart while the command runs finds it named and does not repeat it.
            lad["next"] += 1
            lad["running"] = {"rung": rung, "ts": now}
            self.machine.save(record)
            run = run_command(cmd, node=record.node, gpu=record.gpu if record.gpu is not None else self._gpu(record))
            ok, detail = _outcome(run)
            del lad["running"]
            lad["runs"].append({"rung": rung, "ts": now, "outcome": "passed" if ok else "failed", "detail": detail, **_kept(run)})
            self.machine.save(record)
            if ok:
                return StepResult("passed", f"{rung}: {detail}", {"rung": rung, "rc": run["rc"], "seconds": run["seconds"]})
        return self._rma(record, now, "every rung of the remediation ladder tried: " + "; ".join(f"{r['rung']} {r['outcome']}" for r in lad["runs"]))

    def verify(self, record: Record, now: float) -> StepResult:
        if not self.cfg.verify.command:
            return StepResult("failed", "no return-to-service check configured (remediation.verify.command): the node stays out")
        run = run_command(self.cfg.verify, node=record.node, gpu=record.gpu)
        ok, detail = _outcome(run, self.cfg.verify.pass_exit_codes)
        record.steps.setdefault("ladder", {"next": 0, "runs": []})["runs"].append({"rung": "verify", "ts": now, "outcome": "passed" if ok else "failed", "detail": detail, **_kept(run)})
        return StepResult("passed" if ok else "failed", f"check {'passed' if ok else 'failed'} ({' '.join(run['argv'])}): {detail}", {"rc": run["rc"]})

    # -- rules ---------------------------------------------------------------------------------
    def remediations(self, record: Record, now: float) -> int:
        """Remediations of this node or GPU within the lemon window (from the transition log)."""
        since = now - self.cfg.lemon.window_seconds
        return sum(1 for t in self.machine.history(record.node, limit=10_000)
                   if t.key == record.key and t.rule == "remediated" and t.ts >= since)

    def _cause_findings(self, record: Record) -> list[dict[str, Any]]:
        ids = set(record.causes)
        return [f for f in self.findings_of(record.node) if f.get("id") in ids]

    def _gpu(self, record: Record) -> int | None:
        gpus = {f.get("gpu") for f in self._cause_findings(record)}
        return next(iter(gpus)) if len(gpus) == 1 else None

    def _skip(self, record: Record, rung: str) -> str | None:
        cmd: Command = getattr(self.cfg, rung)
        if not cmd.command:
            return f"no {rung} command configured (remediation.{rung}.command)"
        if rung == "reboot":
            if self.scheduler is None and record.action != "drain_node":
                return "the node cannot be drained first through this scheduler: no reboot"
            return None
        found = self._cause_findings(record)
        if not found:
            return "the causes' findings are unknown: a reset is not known to suffice"
        actions = {xid_table.action(f.get("xid")) for f in found}
        if actions != {"RESET_GPU"}:
            return f"the XID table does not say a GPU reset suffices for every cause ({', '.join(sorted(str(a) for a in actions))})"
        gpu = record.gpu if record.gpu is not None else self._gpu(record)
        if gpu is None:
            return "the causes name no single GPU to reset"
        if self.cfg.gpu_processes.command:
            run = run_command(self.cfg.gpu_processes, node=record.node, gpu=gpu)
            ok, detail = _outcome(run)
            if not ok:
                return f"cannot tell whether a process holds GPU {gpu}: {detail}"
            if run["stdout"].strip():
                return f"a process holds GPU {gpu}: {run['stdout'].strip()[:200]}"
        return None

    # -- RMA and its evidence bundle -------------------------------------------------------------
    def _rma(self, record: Record, now: float, why: str) -> StepResult:
        try:
            path = self.bundle(record, now, why)
            detail = f"{why}; evidence bundle {path}"
        except OSError as exc:
            path, detail = None, f"{why}; the evidence bundle could not be written: {exc.strerror or exc}"
        return StepResult("rma", detail, {"bundle": str(path) if path else None})

    def bundle(self, record: Record, now: float, why: str) -> Path:
        """Write the RMA evidence tarball of `record`; its path."""
        out_dir = Path(self.cfg.bundle.dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))
        name = re.sub(r"[^A-Za-z0-9_.-]", "_", record.key.replace("/", "-gpu"))
        path = out_dir / f"rma-{name}-{stamp}.tar.gz"
        findings = self.findings_of(record.node)
        device = [f for f in findings if f.get("kind") in ("xid", "ecc", "row_remap_failure")]
        members: dict[str, bytes] = {
            "record.json": _json({**record.to_json_dict(), "rma_reason": why}),
            "transitions.json": _json([asdict(t) for t in self.machine.history(record.node, limit=10_000)]),
            "findings.json": _json(findings),
            "xid_ecc_history.json": _json(
                [{k: f.get(k) for k in ("id", "kind", "severity", "ts", "first_seen", "last_seen", "gpu", "xid", "summary", "evidence")} for f in device]
            ),
        }
        manifest: dict[str, Any] = {"node": record.node, "gpu": record.gpu, "key": record.key, "created": now, "reason": why, "parts": {}}
        b = self.cfg.bundle
        for member, cmd in (("kernel_log.txt", b.kernel_log), ("ecc_row_remap.txt", b.ecc)):
            if not cmd.command:
                manifest["parts"][member] = "not configured"
                continue
            run = run_command(cmd, node=record.node, gpu=record.gpu)
            ok, detail = _outcome(run)
            text = run["stdout"]
            if member == "kernel_log.txt":
                pattern = re.compile(b.kernel_log_pattern)
                text = "\n".join([ln for ln in text.splitlines() if pattern.search(ln)][-b.kernel_log_max_lines :]) + "\n"
            if ok:
                members[member] = text.encode()
            manifest["parts"][member] = {"argv": run["argv"], "outcome": detail}
        with tempfile.TemporaryDirectory() as tmp:
            exe = (b.bug_report.command or [None])[0]
            if not b.bug_report.command:
                manifest["parts"]["nvidia-bug-report.log.gz"] = "not configured"
            elif exe is None or shutil.which(exe) is None:
                manifest["parts"]["nvidia-bug-report.log.gz"] = f"{exe} not found on this host"
            else:
                target = Path(tmp) / "nvidia-bug-report.log"
                run = run_command(b.bug_report, node=record.node, gpu=record.gpu, out=target)
                ok, detail = _outcome(run)
                got = [p for p in (target.with_suffix(".log.gz"), target) if p.is_file()]
                if ok and got:
                    members[got[0].name] = got[0].read_bytes()
                manifest["parts"]["nvidia-bug-report.log.gz"] = {"argv": run["argv"], "outcome": detail, "file": got[0].name if got else None}
        manifest["members"] = sorted([*members, "manifest.json"])
        members["manifest.json"] = _json(manifest)
        tmp_path = path.with_suffix(".part")
        with tarfile.open(tmp_path, "w:gz") as tar:
            for member, data in members.items():
                info = tarfile.TarInfo(member)
                info.size, info.mtime, info.mode = len(data), int(now), 0o644
                tar.addfile(info, io.BytesIO(data))
        tmp_path.replace(path)
        return path


def _json(obj: Any) -> bytes:
    return json.dumps(obj, indent=1, sort_keys=True, default=str).encode()


class SlurmDrainer:
    """Drains a Slurm node for a reboot and says when it is drained. A node gpuvigil already
    drained keeps its reason (so that returning it later is still gpuvigil's to do)."""

    def __init__(self, adapter: Any):
        self.adapter = adapter

    def drained(self, node: str) -> bool:
        return self.adapter.state.node(node).gpuvigil_state in ("drained", "down")

    def drain_for_reboot(self, node: str, reason: str) -> str:
        current = self.adapter.state.node(node)
        if "DRAIN" in current.flags:
            return f"{node} already drained ({current.reason}): waiting for its jobs to end"
        self.adapter.drain_node(node, f"{self.adapter.config.reason_prefix} {reason}")
        return f"scontrol drained {node} for the reboot"


def make_steps(cfg: dict[str, Any], machine: QuarantineMachine, *, store: Any = None, adapter: Any = None) -> Ladder | None:
    """The ladder for `Acting` when `remediation.enabled` is on (None: the default hold-down)."""
    rc = remediation_config(cfg)
    if not rc.enabled:
        return None

    def findings_of(node: str) -> list[dict[str, Any]]:
        if store is None or not hasattr(store, "findings_json"):
            return []
        return [json.loads(t) for t in store.findings_json(node=node, limit=1000)]

    drainer = SlurmDrainer(adapter) if adapter is not None and hasattr(adapter, "drain_node") and hasattr(adapter, "state") else None
    return Ladder(rc, machine, findings_of=findings_of, scheduler=drainer)
