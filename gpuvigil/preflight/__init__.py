"""`gpuvigil preflight`: prove a node fit before a job starts on it, or before it returns to service.

A short, configurable list of checks (config section `preflight`) gives one verdict:

- PASS (exit 0): every check that ran passed; checks whose tool is absent were skipped;
- WARN (exit 1): something to look at that does not stop a job (a PCIe link trained narrower,
  persistence mode off, corrected ECC errors piling up);
- FAIL (exit 2): the node must not take the job (uncorrected ECC errors, a pending or failed row
  remap, a hardware slowdown at idle, a process left on a GPU, dcgmi diag failing, memory read
  back wrong, a wrong all-reduce, an InfiniBand port down, a required check that could not run);
- CANNOT_CHECK (exit 3): no driver, no NVML or no GPU. It never passes.

`run_preflight(cfg)` returns the Verdict; the command prints `Verdict.line()` (or `--json`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from gpuvigil.preflight.checks import NoGpu, check_dcgm, check_infiniband, check_nvml, load_nvml, node_name, nvml_gpus
from gpuvigil.preflight.config import PreflightConfig
from gpuvigil.preflight.result import EXIT_CODES, CheckResult, Problem, Verdict, decide

__all__ = ["EXIT_CODES", "CheckResult", "PreflightConfig", "Problem", "Verdict", "run_preflight"]


def run_preflight(cfg: PreflightConfig | dict[str, Any] | None = None, *, nvml: Any = None, sysfs_root: str | Path = "/sys", node: str | None = None) -> Verdict:
    """Run the configured checks on this node. `cfg` is the `preflight` section, or a whole
    loaded config (`gpuvigil.config.load(path)`), or None for the defaults. `nvml` stands in for
    the pynvml module (tests, or a caller that already loaded it); `sysfs_root` is where
    `class/infiniband` is read."""
    if isinstance(cfg, dict):
        from gpuvigil import config

        cfg = config.section("preflight", PreflightConfig, cfg)
    cfg = cfg if cfg is not None else PreflightConfig()
    node = node or node_name()
    start = time.monotonic()
    try:
        nv = nvml if nvml is not None else load_nvml()
        handles = nvml_gpus(nv)
    except NoGpu as exc:
        return Verdict(status="CANNOT_CHECK", node=node, reason=str(exc), seconds=time.monotonic() - start)
    results: list[CheckResult] = []
    try:
        for name in cfg.checks:
            t0 = time.monotonic()
            result = _run_one(name, cfg, nv, handles, sysfs_root)
            if result.status == "skip" and name in cfg.require:
                result = CheckResult.of(name, [Problem(level="fail", message=f"required, but skipped: {result.note}")], note=result.note)
            result.seconds = time.monotonic() - t0
            results.append(result)
    finally:
        try:
            nv.nvmlShutdown()
        except Exception:  # noqa: BLE001 - the verdict stands whatever the driver says on release
            pass
    return decide(node, results, time.monotonic() - start)


def _run_one(name: str, cfg: PreflightConfig, nv: Any, handles: list[Any], sysfs_root: str | Path) -> CheckResult:
    if name == "nvml":
        return check_nvml(nv, handles, cfg.nvml)
    if name == "infiniband":
        return check_infiniband(sysfs_root, cfg.infiniband)
    if name == "dcgm":
        return check_dcgm(cfg.dcgm)
    from gpuvigil.preflight import gpu_load  # torch is imported only by the checks that use it

    if name == "torch_load":
        return gpu_load.check_torch_load(cfg.torch_load, len(handles))
    return gpu_load.check_nccl(cfg.nccl, len(handles))
