"""The sysfs trees of tests/data/sysfs (see its README), kept there as tar files and unpacked once
per test process into a temporary folder.

A real tree links each HCA's `device` back to its PCI function, which holds the HCA: a loop for
anything that copies tests/ following links (mutation testing copies the whole folder)."""

from __future__ import annotations

import atexit
import functools
import shutil
import tarfile
import tempfile
from pathlib import Path

DATA = Path(__file__).parent / "data" / "sysfs"


@functools.cache
def tree(name: str = "two_gpu_ndr") -> Path:
    """The unpacked tree `name` (read-only by convention: a test that changes files copies it)."""
    dest = Path(tempfile.mkdtemp(prefix="gv-sysfs-"))
    atexit.register(shutil.rmtree, dest, True)
    with tarfile.open(DATA / f"{name}.tar.gz") as tar:
        tar.extractall(dest, filter="data")
    return dest / name
