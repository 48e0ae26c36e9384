"""`gpuvigil preflight`: the command (see gpuvigil/preflight/__init__.py for the verdict)."""

from __future__ import annotations

import argparse
import json
import sys


def add_parser(sub) -> None:
    p = sub.add_parser(
        "preflight",
        help="check this node before a job (Slurm prolog, Kubernetes init container): PASS/WARN/FAIL, exit 0/1/2, 3 = cannot check",
        description="Run the preflight checks (config section `preflight`) and print one verdict line. "
        "Exit codes: 0 PASS, 1 WARN, 2 FAIL (also a bad flag or config), 3 CANNOT_CHECK (no GPU, no driver).",
    )
    p.add_argument("--config", help="YAML/JSON config; its `preflight` section chooses the checks and thresholds")
    p.add_argument("--sysfs-root", default="/sys", help="where class/infiniband is read (default /sys)")
    p.add_argument("--node", help="node name in the verdict (default: $SLURMD_NODENAME, $NODE_NAME or the host name)")
    p.add_argument("--checks", help="comma-separated checks to run instead of the configured list (nvml is always run)")
    p.add_argument("--dcgm-level", type=int, choices=(1, 2), help="dcgmi diag run level (default from config)")
    p.add_argument("--json", action="store_true", help="print the verdict and every check's result as one JSON object")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from gpuvigil import config
    from gpuvigil.preflight import run_preflight
    from gpuvigil.preflight.config import PreflightConfig

    overrides: dict = {}
    if args.checks:
        names = [c.strip() for c in args.checks.split(",") if c.strip()]
        overrides.setdefault("preflight", {})["checks"] = (["nvml"] if "nvml" not in names else []) + names
    if args.dcgm_level:
        overrides.setdefault("preflight", {})["dcgm"] = {"level": args.dcgm_level}
    cfg = config.load(args.config, overrides or None)
    verdict = run_preflight(config.section("preflight", PreflightConfig, cfg), sysfs_root=args.sysfs_root, node=args.node)
    if args.json:
        print(json.dumps(verdict.to_json_dict(), sort_keys=True))
    else:
        print(verdict.line())
    sys.stdout.flush()
    return verdict.exit_code
