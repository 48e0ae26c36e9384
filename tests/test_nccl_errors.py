"""NCCL errors that torch raised (`NCCL error in: ...`, the watchdog's `NCCL error: ...`, `NCCL
Error N: ...`) on real logs: the H200 capture (tests/data/h200/s7_nccl_two_ranks.log) and lines
from public threads (tests/data/public/corpus/ncclerr_*.log, sources in labels.yaml). Each becomes
one `nccl_error` finding with the attribution the log has (rank, host, file; a job only where one
is known), through every path that reads logs: `analyze`, `replay`, serve's log collector and
the detector over `events`."""

from __future__ import annotations

import dataclasses
import json
import re
import time
from pathlib import Path

import golden
import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuvigil import schemas
from gpuvigil.offline.analyze import Analyzer
from gpuvigil.collectors.nccl_log import events, parse_lines
from gpuvigil.offline.analyze import training_log_findings as analyze_text
from gpuvigil.detectors.watchdog import NcclErrorDetector, WatchdogTimeoutDetector
from gpuvigil.model import FindingKind, Severity
from gpuvigil.parsers.nccl import NCCL_RESULTS, parse_error_message
from gpuvigil.pipeline.hints import HintPolicy
from gpuvigil.window import Window

DATA = Path(__file__).parent / "data"
CORPUS = DATA / "public" / "corpus"
REAL = sorted(CORPUS.glob("ncclerr_*.log")) + [DATA / "h200" / "s7_nccl_two_ranks.log"]
NOW = 10_000.0


def _parsed(path: Path):
    return parse_lines(path.read_text().splitlines(), reference_ts=0.0)


def test_every_real_error_is_read_golden():
    """Field by field, as each torch generation printed it (golden file); and the behaviour that
    matters on its own: each file's error has its result's name, and the lines after the message
    (`ncclXxx:`, `Last error:` and NCCL's text) were read into it, never as errors of their own."""
    out = {}
    for path in REAL:
        errors = _parsed(path).errors
        out[path.name] = [{k: v for k, v in dataclasses.asdict(e).items() if k not in ("ts", "text")} for e in errors]
    golden.check_json(DATA / "golden" / "nccl_errors.json", out)
    glm = out.pop("ncclerr_glm_132_aborted.log")
    assert glm == []  # "communicator was aborted ... Watchdog caught": a timeout, not an NCCL error
    assert all(len(errs) == 1 and errs[0]["code"] for errs in out.values()), out
    assert {e[0]["code"] for e in out.values()} >= {"ncclRemoteError", "ncclInternalError", "ncclSystemError", "ncclUnhandledCudaError", "ncclInvalidUsage"}
    s7 = out["s7_nccl_two_ranks.log"][0]
    assert (s7["code"], s7["where"], s7["nccl_version"], s7["last_error"]) == (
        "ncclInvalidUsage", "NCCLUtils.cpp:93", "2.28.9", "Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 60")
    assert out["ncclerr_vllm_10453_rank.log"][0]["rank"] == 1
    assert out["ncclerr_pytorch_150916_watchdog.log"][0]["rank"] == 1  # the watchdog's [PG ... Rank 1] tag
    assert out["ncclerr_nccl_520_host.log"][0]["host"] == "compute-dy-p4d24xlarge-77"
    # the next rank's traceback after "Last error:" is not rank 1's last error
    assert out["ncclerr_vllm_10453_rank.log"][0]["last_error"] is None


@pytest.mark.parametrize("path", REAL, ids=lambda p: p.stem)
def test_analyze_pages_each_real_error_once_without_none(path):
    found = analyze_text(path.read_text(), source_file=path.name, reference_ts=NOW)
    errors = [f for f in found if f.kind == FindingKind.NCCL_ERROR]
    if path.name == "ncclerr_glm_132_aborted.log":
        assert errors == [] and [f.kind for f in found] == [FindingKind.NCCL_TIMEOUT]
        return
    assert len(errors) == 1, [f.summary for f in found]
    f = errors[0]
    assert f.severity == Severity.PAGE and f.job is None and f.evidence["code"] and f.source.startswith(f"{path.name}:")
    assert "None" not in f.summary and f.evidence["code"] in f.summary
    # torch's "Some NCCL operations have failed or timed out" announces this error: no timeout too
    assert [g.kind for g in found] == [FindingKind.NCCL_ERROR], [g.summary for g in found]


def test_attribution_the_logs_have_and_causes():
    def one(name: str, **kw):
        [f] = [f for f in analyze_text((CORPUS / name).read_text(), reference_ts=NOW, **kw) if f.kind == FindingKind.NCCL_ERROR]
        return f

    host = one("ncclerr_nccl_520_host.log")
    assert host.node == "compute-dy-p4d24xlarge-77" and host.ranks == []
    assert "): NCCL error (rank unknown, compute-dy-p4d24xlarge-77): ncclInternalError (internal error) at ProcessGroupNCCL.cpp:825" in host.summary
    ranked = one("ncclerr_vllm_10453_rank.log", job="j7", node="n3")
    assert (ranked.job, ranked.ranks, ranked.node) == ("j7", [1], "n3")
    assert ranked.summary.startswith("j7: NCCL error (rank 1, n3): ncclInternalError")
    # cause from NCCL's result and last error: a remote peer gone is the network; NCCL 2.14's
    # "internal error" whose last error is a closed connection is too
    assert one("ncclerr_nccl_2076_remote.log").cause == "network"
    assert one("ncclerr_nccl_1514_internal_net.log").cause == "network"
    assert one("ncclerr_cmt_124_torch1.log").cause == "internal"
    assert one("ncclerr_pytorch_111187_title.log").cause == "cuda"
    s7 = [f for f in analyze_text((DATA / "h200" / "s7_nccl_two_ranks.log").read_text(), reference_ts=NOW) if f.kind == FindingKind.NCCL_ERROR][0]
    assert s7.cause == "software" and s7.node == "vm"  # the NCCL WARN lines' one host


def _error_events(name: str, *, job: str | None, node: str | None, path: str | None) -> pl.DataFrame:
    file = CORPUS / name if (CORPUS / name).exists() else DATA / "h200" / name
    # glog stamps carry no year: read against today, as serve reads them, so they and the NCCL
    # lines' dated stamps agree
    ev = events(parse_lines(file.read_text().splitlines(), reference_ts=time.time()), node=node, job=job, file=path)
    return ev.with_columns(ts=pl.col("ts") - pl.col("ts").max() + NOW)


def _detect(*frames: pl.DataFrame, detector=NcclErrorDetector):
    w = Window(3600.0)
    w.add("events", pl.concat(list(frames), how="diagonal_relaxed"))
    w.seal(NOW)
    return detector().detect(w)


@pytest.mark.parametrize("job, node, path, head", [
    ("j1", "gvx", None, "j1: NCCL error (rank 1, gvx): "),
    (None, "gvx", "/var/log/train/a.log", "Job unknown (log gvx:/var/log/train/a.log): NCCL error (rank 1, gvx): "),
    (None, None, "/var/log/train/a.log", "Job unknown (log /var/log/train/a.log): NCCL error (rank 1): "),
    (None, None, None, "Job unknown: NCCL error (rank 1): "),
])
def test_detector_pages_an_error_with_whatever_attribution_exists(job, node, path, head):
    [f] = _detect(_error_events("ncclerr_pytorch_150916_watchdog.log", job=job, node=node, path=path))
    assert (f.kind, f.severity, f.job, f.ranks, f.node, f.cause) == (FindingKind.NCCL_ERROR, Severity.PAGE, job, [1], node, "network")
    assert f.summary == head + ("ncclRemoteError (remote process exited or there was a network error), NCCL 2.21.5; last error: socketProgress: "
                                "Connection closed by remote peer ip-172-31-36-217.eu-north-1.compute.internal<59116>.")
    assert "None" not in f.summary
    hints = [h.action.value for h in HintPolicy().hints_for(f)]
    assert hints == (["requeue_job"] if job else [])  # no job known: nothing to requeue


def test_detector_hardware_on_the_node_and_software_misuse():
    xid = schemas.frame([{"ts": NOW - 5, "node": "gvx", "gpu": 0, "source": "kernel", "kind": "xid", "xid": 79, "message": "xid"}], schemas.EVENTS)
    [f] = _detect(_error_events("ncclerr_pytorch_111187_title.log", job="j1", node="gvx", path=None), xid)
    assert f.cause == "hardware" and f.node == "gvx" and f.evidence["xids"] == [79] and f.summary.endswith("; XID 79 on gvx.")
    assert [h.action.value for h in HintPolicy().hints_for(f)] == ["cordon_node", "requeue_job"]
    [g] = _detect(_error_events("s7_nccl_two_ranks.log", job="j2", node="vm", path=None))
    assert g.cause == "software" and HintPolicy().hints_for(g) == []  # the owner fixes the program


def test_some_failed_announcing_an_error_is_not_a_timeout_of_its_own():
    """The one-line log joins torch's "Some NCCL operations have failed or timed out" and the
    error: the watchdog detector leaves it to the error; another file's such line still pages."""
    ev = _error_events("ncclerr_alpaca_207_oneline.log", job=None, node="gvx", path="/logs/a.log")
    assert sorted(ev["kind"].to_list()) == ["nccl_error", "nccl_timeout"]
    assert _detect(ev, detector=WatchdogTimeoutDetector) == []
    [e] = _detect(ev)
    assert e.kind == FindingKind.NCCL_ERROR and e.evidence["files"] == ["/logs/a.log"]
    other = ev.filter(pl.col("kind") == "nccl_timeout").with_columns(source=pl.lit("torch:/logs/b.log"))
    [t] = _detect(ev, other, detector=WatchdogTimeoutDetector)
    assert t.kind == FindingKind.NCCL_TIMEOUT and t.evidence["files"] == ["/logs/b.log"]


def test_analyze_and_replay_read_it_from_a_file(tmp_path, capsys):
    log = tmp_path / "train.log"
    log.write_text((DATA / "h200" / "s7_nccl_two_ranks.log").read_text())
    rep = Analyzer(node="gvx").run([log])
    assert [f.kind for f in rep.findings] == [FindingKind.NCCL_ERROR] and rep.formats[str(log)] == "training_log"
    from gpuvigil.cli.main import build_parser

    argv = ["replay", str(log), "--format", "json"]
    args = build_parser(argv).parse_args(argv)
    assert args.func(args) == 0
    said = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    errors = [d for d in said if d.get("kind") == "nccl_error"]
    assert len(errors) == 1 and errors[0]["evidence"]["code"] == "ncclInvalidUsage" and "None" not in errors[0]["summary"]


def test_serve_pages_an_error_from_a_log_whose_path_names_no_job(tmp_path):
    """In process, real collectors: the H200 capture written to a log whose path names no job."""
    from test_serve_e2e_sources import flags, loop_in_thread

    from gpuvigil.app.serve import Server
    from services import wait_for

    logs = tmp_path / "train"
    logs.mkdir()
    server = Server(flags("--port", "0", "--log", f"{logs}/*.log", "--node", "gvx", "--hint-db", str(tmp_path / "h.sqlite")))
    server.start()
    try:
        loop_in_thread(server)
        wait_for(lambda: all(line.endswith(": up") for line in server.describe()), 30, what="the log source read once")
        stamp = time.strftime("%m%d %H:%M:%S", time.localtime())
        text = re.sub(r"([IWEF])\d{4} \d\d:\d\d:\d\d", lambda m: f"{m.group(1)}{stamp}", (DATA / "h200" / "s7_nccl_two_ranks.log").read_text())
        text = re.sub(r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\]", time.strftime("[%Y-%m-%d %H:%M:%S]", time.gmtime()), text)
        log = logs / "rank0.log"
        log.write_text(text)
        f = wait_for(lambda: next((f for f in server.runtime.pipeline.all_findings if f.kind == FindingKind.NCCL_ERROR), None), 30,
                     what="the nccl_error finding")
        assert f.job is None and f.severity == Severity.PAGE and f.evidence["files"] == [str(log)] and f.cause == "software"
        assert f.summary.startswith(f"Job unknown (log gvx:{log}): NCCL error (rank unknown, gvx): ncclInvalidUsage (invalid usage) at NCCLUtils.cpp:93")
        assert "None" not in f.summary
    finally:
        server.stop()
        server.close()


REASONS = sorted(NCCL_RESULTS)
PREFIX = st.sampled_from(["", "[rank3]: ", "node-7: ", "  what():  ", "[E1129 23:07:34.447300897 ProcessGroupNCCL.cpp:1](): "])


@settings(max_examples=150, deadline=None)
@given(
    prefix=PREFIX,
    exc=st.sampled_from(["torch.distributed.DistBackendError: ", "RuntimeError: ", ""]),
    path=st.from_regex(r"(\.\./|/opt/x/)?torch/csrc/distributed/c10d/(ProcessGroupNCCL\.cpp|NCCLUtils\.hpp)", fullmatch=True),
    lineno=st.integers(1, 99999),
    reason=st.sampled_from(REASONS),
    details=st.booleans(),
    version=st.one_of(st.none(), st.from_regex(r"2\.\d{1,2}\.\d{1,2}", fullmatch=True)),
    last=st.one_of(st.none(), st.text(st.characters(min_codepoint=32, max_codepoint=126), min_size=1, max_size=60).filter(lambda s: s.strip())),
)
def test_generated_messages_read_back_whole(prefix, exc, path, lineno, reason, details, version, last):
    msg = f"{prefix}{exc}NCCL error in: {path}:{lineno}, {reason}" + (" (run with NCCL_DEBUG=INFO for details)" if details else "")
    msg += f", NCCL version {version}" if version else ""
    lines = [msg, f"{prefix.strip() + ' ' if prefix.startswith('[rank') else ''}{NCCL_RESULTS[reason]}: some text."]
    if last is not None:
        lines += ["Last error:", last]
    [e] = parse_lines(lines, reference_ts=0.0).errors
    assert (e.reason, e.code, e.where, e.nccl_version) == (reason, NCCL_RESULTS[reason], f"{path.rsplit('/', 1)[-1]}:{lineno}", version)
    assert e.last_error == (last.strip() if last is not None else None)
    assert e.rank == (3 if prefix.startswith("[rank3]") else None) and e.host == ("node-7" if prefix.startswith("node-7") else None)
    # the events stream's one-line message reads back to the same error
    again = parse_error_message(e.message())
    assert again is not None and (again.reason, again.code, again.where, again.nccl_version, again.last_error) == (e.reason, e.code, e.where, e.nccl_version, e.last_error)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.one_of(st.text(max_size=200), st.sampled_from([
    "RuntimeError: NCCL error in: /x/ProcessGroupNCCL.cpp:825, unhandled system error, NCCL version 2.7.8",
    "ncclSystemError: System call (socket, malloc, munmap, etc) failed.", "Last error:", "NCCL error: ", "NCCL Error 99: x",
    "[rank0]: Last error:", "NCCL error in: :, ,", "the docs say NCCL error: something went wrong",
])), max_size=20))
def test_garbage_never_raises_and_prose_is_no_error(lines):
    parsed = parse_lines(lines, reference_ts=0.0)
    for e in parsed.errors:
        assert e.code is not None or e.where is not None or e.nccl_version is not None
        assert parse_error_message(e.message()) is not None
