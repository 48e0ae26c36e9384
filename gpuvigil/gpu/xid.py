"""The NVIDIA XID table (gpuvigil/data/xid.yaml) as typed lookups.

Detectors, collectors and the simulator ask here whether an XID is fatal (the GPU or node needs an
operator) or application-level, and what NVIDIA's immediate action is, so that the table lives in
one data file rather than in code.
"""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict

TABLE_PATH = Path(__file__).parents[1] / "data" / "xid.yaml"

# Xid 154 carries the required action in its text, e.g.
# "GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)".
_RECOVERY_ACTION = re.compile(r"to\s+0x[0-9a-fA-F]+\s*\(([^)]*)\)")
_RECOVERY_ACTIONS_NEEDING_OPERATOR = ("reset", "reboot", "drain")


class XidInfo(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    code: int
    name: str
    action: str
    fatal: bool
    app_level: bool
    category: str
    sympathetic: bool = False
    verified: bool = True
    nonfatal_if_message: str | None = None


@lru_cache(maxsize=1)
def table() -> dict[int, XidInfo]:
    data = yaml.safe_load(TABLE_PATH.read_text())
    return {int(code): XidInfo(code=int(code), **row) for code, row in data["codes"].items()}


def xid_info(code: int | None) -> XidInfo | None:
    """The table row of `code`, or None for a code the table does not know."""
    if code is None:
        return None
    return table().get(int(code))


def is_fatal(code: int | None, message: str = "") -> bool:
    """Whether this XID needs an operator on the GPU/node (reset, reboot, drain).

    Unknown codes are not fatal: we do not cordon a node on a guess; the finding still says
    the code is unknown. `message` refines codes whose text states their own severity.
    """
    info = xid_info(code)
    if info is None:
        return False
    lowered = message.lower()
    if info.nonfatal_if_message and info.nonfatal_if_message in lowered:
        return False
    if info.code == 154 and message:
        m = _RECOVERY_ACTION.search(message)
        if m:
            return any(word in m.group(1).lower() for word in _RECOVERY_ACTIONS_NEEDING_OPERATOR)
    return info.fatal


def action(code: int | None) -> str | None:
    info = xid_info(code)
    return info.action if info else None
