"""Golden-file comparison for the Flight Recorder, allocator and NVML tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

GOLDEN = Path(__file__).parent / "data" / "golden"


def check_golden(name: str, actual: Any) -> None:
    """Compare with tests/data/golden/NAME (`pytest --update-goldens` rewrites it; review the diff)."""
    from golden import check_text

    check_text(GOLDEN / name, json.dumps(actual, indent=1, sort_keys=True, default=str) + "\n")
