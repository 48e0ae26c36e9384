"""Shared helpers for the log/metric parser tests: golden files and real-input paths."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

DATA = Path(__file__).parent / "data"
GOLDEN = DATA / "golden"
H200 = DATA / "h200"
PUBLIC = DATA / "public"
# A fixed "file modified" time for inputs whose lines carry no year (glog, syslog): 2026-11-30.
REFERENCE_TS = 1796000000.0


def check_golden(name: str, actual: Any) -> None:
    """Compare with tests/data/golden/NAME; GPUVIGIL_UPDATE_GOLDEN=1 rewrites it instead."""
    path = GOLDEN / name
    text = actual if isinstance(actual, str) else json.dumps(actual, indent=1, sort_keys=True) + "\n"
    if os.environ.get("GPUVIGIL_UPDATE_GOLDEN") == "1" or not path.exists():
        if os.environ.get("GPUVIGIL_UPDATE_GOLDEN") != "1":
            raise AssertionError(f"golden file {path} is missing; run with GPUVIGIL_UPDATE_GOLDEN=1 to create it, then review it")
        path.write_text(text)
        return
    assert text == path.read_text(), f"output differs from golden file {path} (GPUVIGIL_UPDATE_GOLDEN=1 rewrites it)"


def findings_json(findings: list) -> list[dict]:
    return [f.to_json_dict() for f in findings]
