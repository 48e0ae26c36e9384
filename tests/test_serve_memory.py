"""`serve` gives the C heap's freed memory back after every tick (the soak's RSS slope;
gpuvigil/app/serve_memory.py). glibc keeps freed chunks inside its arenas unless they sit at the top
of a heap; `malloc_trim(0)` returns the free pages in the middle too. These tests check that the
binding reaches glibc's malloc_trim (it releases memory that `free` kept), that serve calls it once
per tick and says so on `/metrics`, and that without glibc nothing is called and nothing breaks.
No RSS figures are asserted: those are the soak's (docs/reliability.md)."""

from __future__ import annotations

import ctypes
import threading

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpuvigil.cli.main import build_parser
from gpuvigil.app.serve import Server
from gpuvigil.app.serve_memory import HeapTrimmer, _glibc

GLIBC = _glibc()
needs_glibc = pytest.mark.skipif(GLIBC is None, reason="malloc_trim is glibc's")


@needs_glibc
def test_trim_releases_freed_memory_that_free_kept():
    libc = GLIBC
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    pinned: list[int] = []

    def fragment() -> None:
        # 2,000 blocks of 32 KB (below the mmap threshold: they live in this thread's arena),
        # touched so their pages are resident; all freed but the last, which pins the top of the
        # heap so that free() cannot give the space back on its own.
        blocks = [libc.malloc(32 << 10) for _ in range(2000)]
        for b in blocks:
            libc.memset(b, 1, 32 << 10)
        for b in blocks[:-1]:
            libc.free(b)
        pinned.append(blocks[-1])

    t = threading.Thread(target=fragment)
    t.start()
    t.join()
    trimmer = HeapTrimmer(libc)
    try:
        assert trimmer.available
        assert trimmer.trim() is True  # glibc: "some memory was released"
        assert (trimmer.trims, trimmer.released) == (1, 1)
    finally:
        libc.free(pinned[0])


def test_without_glibc_trimming_does_nothing():
    trimmer = HeapTrimmer(enabled=False)
    assert not trimmer.available
    assert trimmer.trim() is False
    assert trimmer.trims == 0
    (fam,) = trimmer.families()
    assert fam.name == "gpuvigil_serve_heap_trims" and fam.samples == []


def _trims(text: str) -> dict[str, float]:
    return {s.labels["released"]: s.value for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == "gpuvigil_serve_heap_trims_total"}


@needs_glibc
def test_serve_trims_after_every_tick_and_counts_it_on_metrics(tmp_path):
    full = ["serve", "--port", "0", "--scenario", "healthy", "--nodes", "4", "--speed", "1000", "--tick-log", str(tmp_path / "ticks.log")]
    server = Server(build_parser(full).parse_args(full))
    server.start()
    try:
        server.args.duration = 3.0
        server.loop()
        ticks = len((tmp_path / "ticks.log").read_text().splitlines())
        assert ticks >= 3
        assert server.trimmer.trims == ticks  # one trim per tick, none skipped
        # Nothing scraped during the run: this render is of the last tick, after its trim.
        counts = _trims(httpx.get(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=30).text)
        assert set(counts) == {"yes", "no"} and sum(counts.values()) == ticks
    finally:
        server.close()
