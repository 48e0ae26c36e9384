"""The skips CI allows. Under CI=true every other skip fails the run (tests/conftest.py).

Each entry: a node-id prefix, a regular expression the skip reason must match, and why that skip
may happen on CI's machine (a fresh Debian machine, as root, with no GPU and no services running).
Keep this list short: a dependency the tests need belongs in `make test`, not here.
"""

from __future__ import annotations

import re

ALLOWED: list[tuple[str, str, str]] = [
    # The counterpart of the no-GPU tests: on a machine with a working NVML driver these check the
    # error path that only a GPU-less machine can take. CI has no GPU, so on CI they run.
    ("tests/", r"this machine has a working NVML driver", "runs only where no GPU driver exists"),
    # /dev/kmsg access depends on the container CI runs in, not on anything `make test` installs;
    # the kernel-log parser and the file/journal sources are tested without it.
    ("tests/test_kernel_sources.py", r"/dev/kmsg not (readable|writable) here|cannot write /dev/kmsg here",
     "the sandbox decides whether /dev/kmsg can be read or written"),
    # journald cannot be started inside every container; the journal source is also tested through
    # a journalctl stand-in (tests/fake_journalctl.py).
    ("tests/test_kernel_sources.py", r"systemd-journald", "no journald can run in some containers"),
]


def allowed(nodeid: str, reason: str) -> bool:
    return any(nodeid.startswith(prefix) and re.search(pattern, reason) for prefix, pattern, _why in ALLOWED)
