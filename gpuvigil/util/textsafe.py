"""Text from untrusted files made safe to print on a terminal.

Log messages, file names and dump fields can carry escape sequences (clear the screen, rewrite
the title, hide text, fake a prompt), other control characters, and bidirectional overrides that
make text read differently from what it is. `printable` removes escape sequences and shows every
other such character as a visible escape (`\\x07`, `\\u202e`), and can cut text to a length.
"""

from __future__ import annotations

import re

# ESC-introduced sequences (CSI, OSC, DCS/PM/APC strings, two-byte escapes) and their 8-bit
# C1 forms (CSI U+009B, OSC U+009D, ...).
_ESCAPES = re.compile(
    r"""
      (?:\x1b\[|\x9b)[0-?]*[ -/]*[@-~]?                      # CSI ... final byte
    | (?:\x1b[\]PX^_]|[\x90\x98\x9d\x9e\x9f]).*?(?:\x07|\x1b\\|\x9c|$)   # OSC/DCS/SOS/PM/APC ... ST or BEL
    | \x1b[ -/]*[0-~]?                                         # other escapes (charset, keypad ...)
    """,
    re.VERBOSE | re.DOTALL,
)
# Other C0 controls except TAB (and LF, CR where lines are allowed), DEL, C1, Unicode line and
# paragraph separators, and bidirectional embedding/override/isolate controls.
_CONTROLS_ONE_LINE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069\u200e\u200f\u061c]")
_CONTROLS_MULTI_LINE = re.compile(r"[\x00-\x08\x0b-\x0c\x0e-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069\u200e\u200f\u061c]")


def _visible(m: re.Match[str]) -> str:
    c = m.group()
    return f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}"


def printable(text: object, limit: int | None = None, *, multiline: bool = False) -> str:
    """`text` with escape sequences removed and other control characters shown as escapes.

    Single-line by default (LF and CR shown as `\\x0a`, `\\x0d`); `limit` cuts the result to that
    many characters and says how many were cut."""
    s = text if isinstance(text, str) else str(text)
    if limit is not None and len(s) > 4 * limit + 64:
        s = s[: 4 * limit + 64]  # escapes can only lengthen the text: no need to scan the rest
        full = len(text) if isinstance(text, str) else None
    else:
        full = None
    s = _ESCAPES.sub("", s)
    s = (_CONTROLS_MULTI_LINE if multiline else _CONTROLS_ONE_LINE).sub(_visible, s)
    if multiline:
        s = s.replace("\r\n", "\n").replace("\r", "\\x0d")
    if limit is not None and (len(s) > limit or full is not None):
        total = full if full is not None else len(s)
        cut = s[:limit]
        return f"{cut}… ({total - len(cut)} more characters not shown)"
    return s


__all__ = ["printable"]
