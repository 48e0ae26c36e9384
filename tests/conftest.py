"""Test-wide settings.

Under CI (CI=true) hypothesis runs derandomized: the same generated inputs every run, so a red
build always reproduces. Locally it explores new random inputs each run, which is how the
fuzzers keep finding new garbage to survive.
"""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
    settings.load_profile("ci")
