"""Golden-file comparison for the Flight Recorder, allocator and NVML tests."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

GOLDEN = Path(__file__).parent / "data" / "golden"


def check_golden(name: str, actual: Any) -> None:
    """Compare with tests/data/golden/NAME; GPUVIGIL_UPDATE_GOLDEN=1 writes it instead (review the diff)."""
    path = GOLDEN / name
    text = json.dumps(actual, indent=1, sort_keys=True, default=str) + "\n"
    if os.environ.get("GPUVIGIL_UPDATE_GOLDEN") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return
    assert path.exists(), f"golden file {path} is missing; run with GPUVIGIL_UPDATE_GOLDEN=1 to create it, then review it"
    assert text == path.read_text(), f"output differs from golden file {path} (GPUVIGIL_UPDATE_GOLDEN=1 rewrites it)"
