"""Shared helpers for the log/metric parser tests: golden files and real-input paths."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

DATA = Path(__file__).parent / "data"
GOLDEN = DATA / "golden"
H200 = DATA / "h200"
PUBLIC = DATA / "public"
# A fixed "file modified" time for inputs whose lines carry no year (glog, syslog): 2026-11-30.
REFERENCE_TS = 1796000000.0


def check_golden(name: str, actual: Any) -> None:
    """Compare with tests/data/golden/NAME (`pytest --update-goldens` rewrites it)."""
    from golden import check_text

    check_text(GOLDEN / name, actual if isinstance(actual, str) else json.dumps(actual, indent=1, sort_keys=True) + "\n")


def findings_json(findings: list) -> list[dict]:
    return [f.to_json_dict() for f in findings]
