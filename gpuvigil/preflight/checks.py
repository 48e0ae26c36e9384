"""The preflight's checks that read the machine: NVML, `dcgmi diag`, InfiniBand ports in sysfs.

Each returns a CheckResult; none raises for what it finds. `NoGpu` is the one exception: NVML
cannot be read or lists no GPU, and the whole preflight cannot check (it never passes)."""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

from gpuvigil.preflight.config import CLOCK_REASONS, DcgmCheckConfig, InfinibandCheckConfig, NvmlCheckConfig, Outcome
from gpuvigil.preflight.result import CheckResult, Problem
from gpuvigil.util.textsafe import printable


class NoGpu(Exception):
    """No driver, no NVML library or no GPU: nothing here can be checked."""


def _add(problems: list[Problem], outcome: Outcome, message: str) -> None:
    if outcome != "ignore":
        problems.append(Problem(level=outcome, message=message))


def load_nvml() -> Any:
    try:
        import pynvml
    except ImportError as exc:
        raise NoGpu("the nvidia-ml-py package (pynvml) is not installed") from exc
    return pynvml


def _err(exc: Exception) -> str:
    return printable(str(exc) or type(exc).__name__, 200)


# ---------------------------------------------------------------------------------------- NVML


class _Reader:
    """One NVML reading at a time: NotSupported is None (the GPU has no such thing), any other
    NVML error is a failure naming the reading."""

    def __init__(self, nvml: Any, problems: list[Problem]):
        self.nvml = nvml
        self.problems = problems
        self.not_supported = getattr(nvml, "NVML_ERROR_NOT_SUPPORTED", 3)

    def __call__(self, gpu: int, what: str, fn_name: str, *args: Any) -> Any:
        fn = getattr(self.nvml, fn_name, None)
        if fn is None:
            return None
        try:
            return fn(*args)
        except self.nvml.NVMLError as exc:
            if getattr(exc, "value", None) != self.not_supported:
                self.problems.append(Problem(level="fail", message=f"GPU {gpu}: cannot read {what}: {_err(exc)}"))
            return None


def nvml_gpus(nvml: Any) -> list[Any]:
    """Initialise NVML and return the GPU handles; NoGpu when there are none to check."""
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as exc:
        raise NoGpu(f"no GPU to check: NVML unavailable: {_err(exc)}") from exc
    try:
        count = int(nvml.nvmlDeviceGetCount())
        handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
    except nvml.NVMLError as exc:
        _shutdown(nvml)
        raise NoGpu(f"no GPU to check: NVML cannot list GPUs: {_err(exc)}") from exc
    if not handles:
        _shutdown(nvml)
        raise NoGpu("no GPU to check: NVML lists none on this machine")
    return handles


def _shutdown(nvml: Any) -> None:
    try:
        nvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - releasing a driver handle that may already be gone
        pass


def check_nvml(nvml: Any, handles: list[Any], cfg: NvmlCheckConfig) -> CheckResult:
    problems: list[Problem] = []
    read = _Reader(nvml, problems)
    detail: dict[str, Any] = {"gpus": len(handles)}
    if cfg.expect_gpus is not None and len(handles) != cfg.expect_gpus:
        problems.append(Problem(level="fail", message=f"{len(handles)} GPU(s), expected {cfg.expect_gpus}"))
    uncorrected = getattr(nvml, "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", 1)
    corrected = getattr(nvml, "NVML_MEMORY_ERROR_TYPE_CORRECTED", 0)
    volatile = getattr(nvml, "NVML_VOLATILE_ECC", 0)
    fail_mask = sum(CLOCK_REASONS[r] for r in cfg.fail_clock_reasons)
    warn_mask = sum(CLOCK_REASONS[r] for r in cfg.warn_clock_reasons)
    for i, h in enumerate(handles):
        if cfg.ecc_enabled:
            mode = read(i, "ECC mode", "nvmlDeviceGetEccMode", h)
            if mode is not None and not int(mode[0]):
                problems.append(Problem(level="fail", message=f"GPU {i}: ECC is disabled"))
        dbe = read(i, "uncorrected ECC errors", "nvmlDeviceGetTotalEccErrors", h, uncorrected, volatile)
        if dbe is not None and cfg.max_volatile_uncorrected is not None and int(dbe) > cfg.max_volatile_uncorrected:
            problems.append(Problem(level="fail", message=f"GPU {i}: {int(dbe)} volatile uncorrected ECC error(s) (max {cfg.max_volatile_uncorrected})"))
        sbe = read(i, "corrected ECC errors", "nvmlDeviceGetTotalEccErrors", h, corrected, volatile)
        if sbe is not None and cfg.max_volatile_corrected is not None and int(sbe) > cfg.max_volatile_corrected:
            problems.append(Problem(level="warn", message=f"GPU {i}: {int(sbe)} volatile corrected ECC errors (max {cfg.max_volatile_corrected})"))
        rows = read(i, "remapped rows", "nvmlDeviceGetRemappedRows", h)
        if rows is not None:
            _cor, _unc, pending, failure = rows
            if pending:
                _add(problems, cfg.pending_remap, f"GPU {i}: a row remap is pending (needs a GPU reset)")
            if failure:
                _add(problems, cfg.remap_failure, f"GPU {i}: a row remap failed (memory cannot be repaired)")
        reasons_fn = "nvmlDeviceGetCurrentClocksEventReasons" if hasattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons") else "nvmlDeviceGetCurrentClocksThrottleReasons"
        reasons = read(i, "clock event reasons", reasons_fn, h)
        if reasons is not None:
            for level, mask in (("fail", fail_mask), ("warn", warn_mask)):
                hit = [n for n, bit in CLOCK_REASONS.items() if int(reasons) & mask & bit]
                if hit:
                    problems.append(Problem(level=level, message=f"GPU {i}: clocks held down at idle ({', '.join(hit)})"))  # type: ignore[arg-type]
        width = read(i, "PCIe link width", "nvmlDeviceGetCurrPcieLinkWidth", h)
        max_width = read(i, "PCIe max link width", "nvmlDeviceGetMaxPcieLinkWidth", h)
        if width is not None and max_width is not None and int(width) < int(max_width):
            _add(problems, cfg.pcie_width_degraded, f"GPU {i}: PCIe link x{int(width)}, the GPU trains at x{int(max_width)}")
        persistence = read(i, "persistence mode", "nvmlDeviceGetPersistenceMode", h)
        if persistence is not None and not int(persistence):
            _add(problems, cfg.persistence_off, f"GPU {i}: persistence mode is off")
        procs = read(i, "compute processes", "nvmlDeviceGetComputeRunningProcesses", h)
        if procs:
            pids = sorted(int(p.pid) for p in procs)
            _add(problems, cfg.processes_present, f"GPU {i}: {len(pids)} process(es) already on it (pid {', '.join(map(str, pids[:5]))})")
    return CheckResult.of("nvml", problems, note=f"{len(handles)} GPU(s)", detail=detail)


# ---------------------------------------------------------------------------------------- DCGM

_STATUS = {"pass": "pass", "passed": "pass", "fail": "fail", "failed": "fail", "warn": "warn", "warning": "warn", "skip": "skip", "skipped": "skip"}


def _texts(value: Any) -> list[str]:
    """DCGM's warnings: strings (3.x) or objects with a `warning`/`message` (4.x)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [str(value.get("warning") or value.get("message") or "")]
    if isinstance(value, list):
        return [t for v in value for t in _texts(v)]
    return []


def parse_dcgm_diag(text: str) -> tuple[list[tuple[str, str, str]], str | None]:
    """`dcgmi diag -j` output → ([(test, status, message)], error). Status is pass / fail /
    warn / skip / not_run; anything DCGM may add later is not_run, never a pass. Handles the 3.x
    shape ("DCGM GPU Diagnostic" → test_categories → tests → results) and tests at the top (4.x).
    Text before the JSON (a warning line) is skipped; garbage is an error, never a pass."""
    start = text.find("{")
    if start < 0:
        return [], "no JSON in dcgmi output"
    try:
        data, _ = json.JSONDecoder().raw_decode(text[start:])
    except (ValueError, RecursionError):
        return [], "dcgmi output is not valid JSON"
    if not isinstance(data, dict):
        return [], "dcgmi output is not a JSON object"
    root = data.get("DCGM GPU Diagnostic") or data.get("DCGM Diagnostic") or data
    if not isinstance(root, dict):
        return [], "dcgmi output has no diagnostic object"
    error = root.get("runtime_error") or data.get("runtime_error")
    tests: list[Any] = []
    for cat in root.get("test_categories") or []:
        if isinstance(cat, dict) and isinstance(cat.get("tests"), list):
            tests.extend(cat["tests"])
    if isinstance(root.get("tests"), list):
        tests.extend(root["tests"])
    out: list[tuple[str, str, str]] = []
    for test in tests:
        if not isinstance(test, dict):
            continue
        name = printable(str(test.get("name") or "unnamed test"), 80)
        results = test.get("results") if isinstance(test.get("results"), list) else []
        for r in results or [{}]:
            if not isinstance(r, dict):
                continue
            status = _STATUS.get(str(r.get("status", "")).strip().lower(), "not_run")
            gpus = r.get("gpu_ids", r.get("entity_id"))
            msg = "; ".join(t for t in _texts(r.get("warnings")) if t)
            where = f" (GPU {printable(str(gpus), 40)})" if gpus not in (None, "") else ""
            out.append((name + where, status, printable(msg, 300)))
    return out, printable(str(error), 300) if error else None


def check_dcgm(cfg: DcgmCheckConfig) -> CheckResult:
    exe = shutil.which(cfg.command)
    if exe is None:
        return CheckResult.skipped("dcgm", f"{cfg.command} not installed")
    cmd = [exe, "diag", "-r", str(cfg.level), "-j"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=cfg.timeout_seconds, check=False)
    except subprocess.TimeoutExpired:
        return CheckResult.of("dcgm", [Problem(level="fail", message=f"dcgmi diag -r {cfg.level} did not finish in {cfg.timeout_seconds:g} s")])
    except OSError as exc:
        return CheckResult.of("dcgm", [Problem(level="fail", message=f"cannot run {cfg.command}: {_err(exc)}")])
    results, error = parse_dcgm_diag(proc.stdout)
    problems: list[Problem] = []
    for name, status, msg in results:
        if status in ("fail", "warn"):
            problems.append(Problem(level=status, message=f"dcgmi diag -r {cfg.level} {name}: {status}" + (f": {msg}" if msg else "")))  # type: ignore[arg-type]
        elif status == "not_run":
            problems.append(Problem(level="fail", message=f"dcgmi diag -r {cfg.level} {name}: no result (status not recognised)"))
    if results and all(st == "skip" for _, st, _ in results) and not error and proc.returncode == 0:
        # DCGM skips what this GPU cannot run: nothing was established, neither pass nor fail.
        return CheckResult.skipped("dcgm", f"dcgmi diag -r {cfg.level} skipped every test")
    if error:
        problems.append(Problem(level="fail", message=f"dcgmi diag -r {cfg.level}: {error}"))
    if not results and not error:
        problems.append(Problem(level="fail", message=f"dcgmi diag -r {cfg.level} ran no test" + (f" (exit {proc.returncode})" if proc.returncode else "")))
    elif proc.returncode != 0 and not any(p.level == "fail" for p in problems):
        # dcgmi says it failed but no test says why: it is not a pass.
        tail = printable((proc.stderr or proc.stdout).strip().splitlines()[-1] if (proc.stderr or proc.stdout).strip() else "", 200)
        problems.append(Problem(level="fail", message=f"dcgmi diag -r {cfg.level} exited {proc.returncode}" + (f": {tail}" if tail else "")))
    counts = {s: sum(1 for _, st, _ in results if st == s) for s in ("pass", "fail", "warn", "skip", "not_run")}
    return CheckResult.of("dcgm", problems, note=f"level {cfg.level}: " + ", ".join(f"{n} {s}" for s, n in counts.items() if n), detail=counts)


# ---------------------------------------------------------------------------------- InfiniBand


def read_ib_ports(sysfs_root: str | Path) -> list[dict[str, Any]]:
    """Every port under <sysfs-root>/class/infiniband, read once by the InfiniBand collector (the
    same parsing as `serve`): device, port, state, phys_state, rate_gbps, width, speed."""
    from gpuvigil.collectors.infiniband import InfinibandCollector

    df = InfinibandCollector(sysfs_root, node="preflight").read(0.0)
    cols = ["device", "port", "state", "phys_state", "rate_gbps", "width", "speed", "link_layer"]
    return [r for r in df.select([c for c in cols if c in df.columns]).to_dicts() if r.get("device") is not None]


def _rate_text(p: dict[str, Any]) -> str:
    if p.get("rate_gbps") is None:
        return "unreadable"
    lanes = f" ({p['width']}X {p['speed'] or ''})".replace(" )", ")") if p.get("width") else ""
    return f"{p['rate_gbps']:g} Gb/s{lanes}"


def check_infiniband(sysfs_root: str | Path, cfg: InfinibandCheckConfig) -> CheckResult:
    ports = [p for p in read_ib_ports(sysfs_root) if not any(fnmatch.fnmatchcase(p["device"], pat) for pat in cfg.ignore_devices)]
    if not ports and not cfg.expect_ports:
        return CheckResult.skipped("infiniband", f"no InfiniBand port under {Path(sysfs_root) / 'class' / 'infiniband'}")
    problems: list[Problem] = []
    if cfg.expect_ports is not None and len(ports) != cfg.expect_ports:
        problems.append(Problem(level="fail", message=f"{len(ports)} InfiniBand port(s), expected {cfg.expect_ports}"))
    for p in ports:
        name = f"{printable(p['device'], 40)} port {p['port']}"
        if p.get("state") != "ACTIVE":
            problems.append(Problem(level="fail", message=f"{name} is {p.get('state') or 'unreadable'}, not ACTIVE"))
        elif p.get("phys_state") != "LinkUp":
            problems.append(Problem(level="fail", message=f"{name} physical state {p.get('phys_state') or 'unreadable'}, not LinkUp"))
        if cfg.min_rate_gbps is not None and (p.get("rate_gbps") is None or p["rate_gbps"] < cfg.min_rate_gbps):
            problems.append(Problem(level="fail", message=f"{name} rate {_rate_text(p)}, expected at least {cfg.min_rate_gbps:g} Gb/s"))
    return CheckResult.of("infiniband", problems, note=f"{len(ports)} port(s)", detail={"ports": ports})


def node_name() -> str:
    return os.environ.get("SLURMD_NODENAME") or os.environ.get("NODE_NAME") or os.uname().nodename
