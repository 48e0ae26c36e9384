"""Findings whose events carry only part of their attribution (logs often name no job, a kernel
line on a VM no GPU index, a line without torchrun's prefix no rank, a journal without a host name
no node): every path from a parsed event to a finding still raises it, keeps what is known, and
words what is missing as unknown. No summary, hint reason or alert annotation ever says "None"
or "null".

Inputs are real lines: the H200 captures (tests/data/h200/: the NCCL watchdog timeout, the
capacity and fragmentation OOMs), public kernel logs (tests/data/public/: Xid 79, 13, 94 lines) and
the NVML event wording of `collectors/nvml.py` for a double-bit ECC event. Each goes through the
real parsers, then through every default detector (`detectors.registry.default_detectors`).
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import polars as pl
import pytest

from gpuvigil import schemas
from gpuvigil.collectors import dcgm, kernel_log, nccl_log
from gpuvigil.offline.analyze import training_log_findings
from gpuvigil.detectors.registry import default_detectors
from gpuvigil.offline.analyze import kernel_log_findings, scrape_findings
from gpuvigil.model import Finding, FindingKind, place, subject
from gpuvigil.pipeline.hints import HintPolicy
from gpuvigil.window import Window

DATA = Path(__file__).parent / "data"
NOW = 1_796_000_000.0
BAD = re.compile(r"\bNone\b|\bnull\b")


def _kernel_message(name: str, code: int) -> str:
    rows = kernel_log.parse_lines((DATA / "public" / name).read_text().splitlines(), reference_ts=NOW)
    return rows.filter(pl.col("xid") == code)["message"][0]


def _torch_message(name: str, kind: str) -> str:
    ev = nccl_log.events(nccl_log.parse_lines((DATA / "h200" / name).read_text().splitlines(), reference_ts=NOW))
    return ev.filter(pl.col("kind") == kind)["message"][0]


# (case, event without attribution, the finding kind that must come of it)
EVENTS = [
    ("xid79_fallen_off_bus", {"source": "kernel", "kind": "xid", "xid": 79, "message": _kernel_message("kernel_fallen_off_bus.log", 79)}, FindingKind.XID),
    ("xid13_application", {"source": "kernel", "kind": "xid", "xid": 13, "message": _kernel_message("kernel_xids.log", 13)}, FindingKind.XID),
    ("xid94_contained_ecc", {"source": "kernel", "kind": "xid", "xid": 94, "message": _kernel_message("corpus/xid_gpud_1174_94.log", 94)}, FindingKind.ECC),
    ("nvml_ecc_dbe", {"source": "nvml", "kind": "ecc_dbe", "message": "NVML event type 0x2 data 0"}, FindingKind.ECC),
    ("oom_capacity_h200", {"source": "torch", "kind": "oom", "message": _torch_message("s2_oom_ramp.log", "oom")}, FindingKind.OOM_CAPACITY),
    ("oom_fragmentation_h200", {"source": "torch", "kind": "oom", "message": _torch_message("s3_fragmentation.log", "oom")}, FindingKind.OOM_FRAGMENTATION),
    ("watchdog_h200", {"source": "torch", "kind": "nccl_timeout", "message": _torch_message("s6_nccl_watchdog_timeout.log", "nccl_timeout")}, FindingKind.NCCL_TIMEOUT),
    ("watchdog_h200_from_a_file", {"source": "torch:/var/log/train/rank0.log", "kind": "nccl_timeout",
                                   "message": _torch_message("s6_nccl_watchdog_timeout.log", "nccl_timeout")}, FindingKind.NCCL_TIMEOUT),
    ("some_nccl_operations_failed", {"source": "torch", "kind": "nccl_timeout", "message": "Some NCCL operations have failed or timed out"}, FindingKind.NCCL_TIMEOUT),
]
# every combination of what an event may lack
ATTRIBUTION = [dict(zip(("node", "gpu", "job", "rank"), combo)) for combo in itertools.product(("gv-node-3", None), (2, None), ("4242", None), (5, None))]


def _ids(a: dict) -> str:
    return "-".join(f"{k}={'_' if v is None else v}" for k, v in a.items())


def _texts(found: list[Finding]) -> list[str]:
    """Every text a person reads about these findings: summaries and hint reasons (an alert's
    annotation is the summary: test_alert_annotations_carry_the_summary_only)."""
    out = [f.summary for f in found]
    out += [h.reason for f in found for h in HintPolicy().hints_for(f)]
    return out


@pytest.mark.parametrize("attribution", ATTRIBUTION, ids=_ids)
@pytest.mark.parametrize("case, event, kind", EVENTS, ids=[c for c, _, _ in EVENTS])
def test_every_event_path_raises_its_finding_and_never_says_none(case, event, kind, attribution):
    row = {"ts": NOW - 1.0, **event, **attribution}
    window = Window(3600.0)
    window.add("events", schemas.frame([row], schemas.EVENTS))
    window.seal(NOW)
    found = [f for d in default_detectors() for f in d.detect(window)]
    mine = [f for f in found if f.kind == kind]
    assert len(mine) == 1, (case, [(f.kind.value, f.summary) for f in found])  # never dropped, never doubled
    f = mine[0]
    # what the event knew is kept; what it did not know is not invented
    assert f.job == attribution["job"]
    if kind != FindingKind.NCCL_TIMEOUT:  # the watchdog names a node only as culprit or for a job-less log
        assert (f.node, f.gpu) == (attribution["node"], attribution["gpu"])
    for text in _texts(found):
        assert not BAD.search(text), (case, text)
    if attribution["node"]:
        assert attribution["node"] in f.summary
    if attribution["job"] and kind != FindingKind.ECC:
        assert attribution["job"] in f.summary


def test_alert_annotations_carry_the_summary_only():
    """The alert a finding becomes says what its summary says (and the evidence as JSON)."""
    from gpuvigil.alerts.pusher import AlertPusher
    from gpuvigil.alerts.settings import load_settings

    pusher = AlertPusher.__new__(AlertPusher)
    pusher.settings = load_settings(None)
    row = {"ts": NOW - 1.0, **EVENTS[2][1], "node": None, "gpu": None, "job": None, "rank": None}
    window = Window(3600.0)
    window.add("events", schemas.frame([row], schemas.EVENTS))
    window.seal(NOW)
    [f] = [f for d in default_detectors() for f in d.detect(window)]
    alert = pusher.alert_for(f, {}, starts_at=NOW, ends_at=NOW + 300)
    assert alert["annotations"]["summary"] == f.summary == (
        "Uncorrectable ECC error on an unknown node and GPU (XID 94): drain the node and reset the GPU before it runs anything again.")
    assert all(not BAD.search(v) for k, v in alert["annotations"].items() if k != "evidence")
    assert "node" not in alert["labels"] and "gpu" not in alert["labels"]  # empty labels are left out


def _strip_ranks(text: str) -> str:
    """The H200 watchdog log as a launcher without torchrun's prefixes would leave it: no rank."""
    return re.sub(r"\[rank\d+\]:|\s*Rank \d+\]|\[Rank \d+\]\s*", lambda m: "]" if m.group(0).strip().endswith("]") and "PG" in m.group(0) else "", text)


OFFLINE = [
    ("watchdog_without_rank", lambda: training_log_findings(_strip_ranks((DATA / "h200" / "s6_nccl_watchdog_timeout.log").read_text()), reference_ts=NOW),
     FindingKind.NCCL_TIMEOUT),
    ("kernel_log_without_node_or_gpu_index", lambda: kernel_log_findings((DATA / "public" / "kernel_fallen_off_bus.log").read_text(), reference_ts=NOW),
     FindingKind.XID),
    ("dcgm_scrape_without_host_or_gpu_label", lambda: scrape_findings(
        dcgm.parse_text(re.sub(r'(?:Hostname|gpu)="[^"]*",?', "", (DATA / "dcgm" / "node07_constructed.prom").read_text()), ts=NOW)[0], [], NOW),
     FindingKind.ECC),
]


@pytest.mark.parametrize("case, run, kind", OFFLINE, ids=[c for c, _, _ in OFFLINE])
def test_offline_readers_never_say_none(case, run, kind):
    found = run()
    assert any(f.kind == kind for f in found), [(f.kind.value, f.summary) for f in found]
    for text in _texts(found):
        assert not BAD.search(text), (case, text)


@pytest.mark.parametrize(
    "kw, words",
    [
        ({"node": "n0", "gpu": 2}, "n0 GPU 2"),
        ({"node": "n0", "gpu": None}, "n0 (GPU unknown)"),
        ({"node": None, "gpu": 2}, "GPU 2 of an unknown node"),
        ({"node": None, "gpu": None}, "an unknown node and GPU"),
        ({"node": None, "gpu": None, "pci": "0000:3b:00"}, "the GPU at PCI 0000:3b:00 of an unknown node"),
        ({"node": "n0", "gpu": 0, "pci": "0000:3b:00"}, "n0 GPU 0"),  # the index, when known, is what people use
    ],
)
def test_place_words_each_missing_part(kw, words):
    assert place(kw.pop("node"), kw.pop("gpu"), **kw) == words


@pytest.mark.parametrize(
    "kw, words",
    [
        ({"job": "4242", "ranks": [3], "node": "n0", "gpu": 1}, "job 4242 rank 3 on n0 GPU 1"),
        ({"job": "4242", "ranks": [0, 1], "node": "n0"}, "job 4242 ranks 0, 1 on n0 (GPU unknown)"),
        ({"job": None, "ranks": [None], "node": None, "gpu": None}, "an unknown job on an unknown node and GPU"),
        ({"job": None, "ranks": [7], "where": False}, "an unknown job rank 7"),
    ],
)
def test_subject_words_each_missing_part(kw, words):
    assert subject(**kw) == words
