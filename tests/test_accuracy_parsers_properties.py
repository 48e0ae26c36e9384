"""Property tests: the log and message parsers survive garbage (untrusted logs) and keep their
invariants."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gpuvigil.offline.analyze import smi_findings
from gpuvigil.parsers import nvidia_smi
from gpuvigil.parsers.nccl import parse_lines, unwrap
from gpuvigil.parsers.oom import parse_oom
from gpuvigil.parsers.xid_line import iter_xid_records

TEXT = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=400)
LINES = st.lists(st.one_of(TEXT, st.sampled_from([
    "NVRM: Xid (PCI:0000:dc:00): 45, pid=1, name=python3, Ch 00000001 caused by previous Xid 149",
    "[ 1843.308145] NVRM: The NVIDIA GPU 0000:b3:00.0",
    "               NVRM: fallen off the bus and is not responding to commands.",
    "NVRM: GPU 0000:06:00.0: GPU has fallen off the bus.",
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.55 GiB (GPU 0; 23.99 GiB total capacity; 20.44 GiB already",
    "allocated; 0 bytes free; 22.59 GiB reserved in total by PyTorch)",
    "[Rank 2] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=4, OpType=BROADCAST, Timeout(ms)=1800000) ran f",
    "or 1800010 milliseconds before timing out.",
    "    Remapped Rows", "        Pending                           : Yes", "",
])), max_size=30)


@settings(max_examples=150, deadline=None)
@given(LINES)
def test_xid_records_survive_garbage_and_attribute_causes(lines):
    for offset, line, rec in iter_xid_records(lines):
        assert 0 <= offset < len(lines)
        assert rec.root == (rec.caused_by if rec.caused_by is not None else rec.code)
        assert rec.code >= 0


@settings(max_examples=150, deadline=None)
@given(LINES)
def test_unwrap_keeps_order_and_never_loses_a_line_it_did_not_join(lines):
    out = list(unwrap(lines))
    offsets = [o for o, _ in out]
    assert offsets == sorted(offsets) and len(set(offsets)) == len(offsets)
    assert len(out) <= len(lines)
    parse_lines(lines, reference_ts=0.0)  # never raises


@settings(max_examples=150, deadline=None)
@given(TEXT, st.floats(min_value=0, max_value=1e6), st.floats(min_value=0, max_value=1e6), st.floats(min_value=0, max_value=1e6))
def test_oom_classification_is_total_and_cause_first(junk, req, free, unalloc):
    msg = f"{junk} CUDA out of memory. Tried to allocate {req:.2f} MiB. GPU 0 has a total capacity of 80.00 GiB of which {free:.2f} MiB is free. Of the allocated memory 1.00 GiB is allocated by PyTorch, and {unalloc:.2f} MiB is reserved by PyTorch but unallocated."
    rep = parse_oom(msg)
    assert rep is not None
    kind = rep.classify().value
    r, f, u = rep.requested_bytes, rep.free_bytes, rep.reserved_unallocated_bytes
    headroom = max(64 << 20, 0.01 * r)  # oom_classify.yaml: driver_headroom_bytes, driver_headroom_fraction
    if u >= r:
        assert kind == "oom_fragmentation"
    elif f >= r + headroom:
        assert kind == "oom_unexplained"
    else:  # no other process listed: the cache's pieces and the free memory are never added up
        assert kind == "oom_capacity"


@settings(max_examples=150, deadline=None)
@given(LINES)
def test_nvidia_smi_parser_survives_garbage(lines):
    text = "\n".join(lines)
    smi_findings(text, ts=0.0)
    nvidia_smi.xid_counter_samples(text)
