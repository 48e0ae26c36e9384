"""Checked-in generated files (alert rules, dashboards): write them, or check they are current.

Shared by the `alerts` and `dashboards` builders so neither imports the other."""

from __future__ import annotations

import difflib
import sys
from collections.abc import Mapping
from pathlib import Path

from gpuvigil.errors import UserError


def write_or_check(files: Mapping[str, str], out: Path, *, check: bool, what: str) -> int:
    """Write generated files into `out`, or with `check` report those that differ (exit 1)."""
    if check:
        stale = []
        for name, text in files.items():
            path = out / name
            current = path.read_text() if path.exists() else None
            if current != text:
                stale.append(name)
                diff = difflib.unified_diff((current or "").splitlines(True), text.splitlines(True), f"{path} (checked in)", f"{path} (generated)", n=1)
                sys.stdout.writelines(list(diff)[:40])
        if stale:
            print(f"{what}: {len(stale)} file(s) out of date in {out}: {', '.join(stale)} (run without --check to regenerate)", file=sys.stderr)
            return 1
        print(f"{what}: {len(files)} file(s) in {out} are current")
        return 0
    try:
        out.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            tmp = out / f".{name}.tmp"
            tmp.write_text(text)
            tmp.replace(out / name)
    except OSError as exc:
        raise UserError(f"cannot write {what} into {out}: {exc.strerror or exc}") from exc
    print(f"{what}: wrote {len(files)} file(s) into {out}")
    return 0
