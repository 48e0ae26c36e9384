"""Golden files: the one place that compares output with `tests/data/golden/...` files.

A golden file is rewritten only by an explicit, reviewed run: `pytest --update-goldens` (the
option is defined in `tests/conftest.py`). No environment variable switches it on, so a shell
with a stray variable set cannot turn golden tests into checks that always pass. Without the
option a missing golden file is a failure, never silently created. Every golden test also asserts
the behaviour that matters on its own, so a regenerated golden cannot hide a regression.

Import it as `golden` (tests/ is on sys.path under pytest), never as `tests.golden`: the flag lives
in this one module object.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# Set by conftest.pytest_configure from `--update-goldens`; nothing else may set it.
UPDATE = False
# Files rewritten in this session (listed in the terminal summary for review).
REWRITTEN: list[Path] = []

HOW = "pytest --update-goldens <the test>"


def check_text(path: Path, text: str) -> None:
    """`text` must equal the golden file at `path` (rewritten instead under --update-goldens)."""
    path = Path(path)
    if UPDATE:
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
            REWRITTEN.append(path)
        return
    assert path.exists(), f"golden file {path} is missing: create it with `{HOW}` and review it"
    assert text == path.read_text(), f"output differs from golden file {path} (after a deliberate change: `{HOW}`, then review the diff)"


def check_json(path: Path, actual: Any, *, default: Any = None) -> None:
    """Like `check_text` for a JSON-serialisable value, compared as data (key order free)."""
    path = Path(path)
    text = json.dumps(actual, indent=1, sort_keys=True, default=default) + "\n"
    if UPDATE:
        check_text(path, text)
        return
    assert path.exists(), f"golden file {path} is missing: create it with `{HOW}` and review it"
    assert json.loads(path.read_text()) == json.loads(text), f"output differs from golden file {path} (after a deliberate change: `{HOW}`, then review the diff)"
