"""Example counts for the hypothesis equivalence tests.

These tests compare incremental detector state with a from-scratch oracle over generated streams;
each example replays a whole stream, so their cost grows with the count. CI draws a quarter of
the full count (at least 10), derandomized (tests/conftest.py); `make test-deep` sets
GPUVIGIL_TEST_DEEP=1 and draws all of it.
"""

from __future__ import annotations

import os

DEEP = os.environ.get("GPUVIGIL_TEST_DEEP", "").lower() in ("1", "true", "yes")


def examples(full: int) -> int:
    return full if DEEP else max(10, full // 4)
