"""Give the C heap's freed memory back to the system after each `serve` tick (glibc only).

Why (measured in the soak, docs/reliability.md): at 10,000 GPUs each `/metrics`
render builds ~240,000 lines and a ~25 MB string in the scrape's thread, and the tick builds and
drops tens of MB of Python objects. glibc keeps what is freed inside its arenas (one per thread
that allocated; the scrape threads come and go) unless it lies at the very top of a heap, so
`serve`'s RSS held 30-87 MB of freed heap (mallinfo2's fordblks) and wandered with where the last
big allocations had landed. `malloc_trim(0)` walks every arena and returns the free pages inside
them (madvise), which `free` never does on its own: called once by hand on serve in the soak, RSS
fell 383 -> 325 MB at once. It costs under 1 ms when little is free, ~16 ms after 120 MB were
freed (measured in a test process).

Setting MALLOC_ARENA_MAX in the environment also helps but only works when set before the process
starts (`mallopt(M_ARENA_MAX)` from Python is too late: the imports have started threads), and it
serialises the threads' allocations; trimming needs neither. Other C libraries (musl) return
memory differently and have no `malloc_trim`: there `trim()` does nothing. polars allocates with
its own jemalloc, which returns freed pages by itself on a timer (its background threads).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import threading
from typing import Any

log = logging.getLogger("gpuvigil.app.serve")


def _glibc() -> Any | None:
    """This process's C library, if it is glibc and has malloc_trim; else None."""
    try:
        version = os.confstr("CS_GNU_LIBC_VERSION")
    except (ValueError, OSError, AttributeError):  # not glibc, or no confstr (not POSIX)
        return None
    if not version or not version.startswith("glibc"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return libc


class HeapTrimmer:
    """`trim()` after each tick; counts what it did for `/metrics`."""

    def __init__(self, libc: Any | None = None, enabled: bool = True):
        self._libc = (libc if libc is not None else _glibc()) if enabled else None
        self._lock = threading.Lock()  # trims from the tick loop only, but counters are read by scrapes
        self.trims = 0  # calls that reached malloc_trim
        self.released = 0  # calls after which glibc said it gave memory back

    @property
    def available(self) -> bool:
        return self._libc is not None

    def trim(self) -> bool:
        """Return the C heap's free pages to the system; True if glibc released any."""
        if self._libc is None:
            return False
        released = bool(self._libc.malloc_trim(0))
        with self._lock:
            self.trims += 1
            self.released += released
        return released

    def families(self) -> list[Any]:
        from gpuvigil.exporter.metrics import Family

        fam = Family("gpuvigil_serve_heap_trims", "counter",
                     "malloc_trim(0) calls after ticks (glibc: freed C-heap pages returned to the system), by whether any memory was released.")
        if self._libc is not None:
            with self._lock:
                fam.add(self.released, released="yes")
                fam.add(self.trims - self.released, released="no")
        return [fam]
