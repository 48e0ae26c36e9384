"""PyTorch Flight Recorder dumps: read one per rank, match collectives across ranks, name culprits.

Torch writes one dump per rank (`TORCH_NCCL_DEBUG_INFO_TEMP_FILE` prefix + rank, or
`torch._C._distributed_c10d._dump_fr_trace()` / `_dump_fr_trace_json()`): a dict with
`version`, `pg_config` (process groups and their ranks), `pg_status` (last enqueued / started /
completed collective per group) and `entries`, a ring buffer of the last collectives each with
its group, `collective_seq_id`, `profiling_name` (`nccl:all_reduce`), sizes, dtypes and state.
The pickle form is read with the restricted unpickler; the JSON form carries the same data with
numbers as strings in `pg_status` and 0 for "not yet" timestamps, which are normalised here.

Cross-rank analysis follows the idea of PyTorch's `fr_trace` tool: within a process group,
every member must call the same collective with the same sequence id. Walking the sequence ids
in order, the first one that some members never reached is a hang (`collective_hang`, the
culprits are those who did not join), and the first one whose members disagree on the op, the
sizes or the dtypes is a mismatch (`collective_mismatch`, the culprits are the minority).
Later problems in the same group are consequences of the first and are not reported. This module
reads and matches (`analyze_dumps` returns one `GroupAnalysis` per group); whether an analysis
pages is decided by the registered detectors that read it as an `fr_analysis` row
(`collectors/fr_dumps.py`'s `analysis_rows`): `hang_fr` and `fr_mismatch`, live and offline.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuvigil.collectors.safe_pickle import looks_like_pickle, safe_load
from gpuvigil.errors import UserError
from gpuvigil.model import GroupAnalysis

MAX_DUMP_BYTES = 256 * 1024 * 1024
# Work bounds on one dump, before it is parsed: torch keeps at most TORCH_NCCL_TRACE_BUFFER_SIZE
# entries (2,000 by default); a pickle's items are counted with shared parts each time they are
# reached (collectors.safe_pickle), so 2 million references to one entry are 2 million entries.
MAX_DUMP_ENTRIES = 200_000
MAX_DUMP_ITEMS = 10_000_000
_SNIFF_BYTES = 64 * 1024
# A collective all ranks joined but none finished is a hang only once it has been pending this
# long at dump time: healthy steps finish their collectives in well under a second to a few
# seconds, and a watchdog-timeout dump comes after TORCH_NCCL's timeout (10 min by default).
STUCK_AFTER_SECONDS = 10.0
# `fr_trace` takes the rank from the digits that end the file name (prefix + rank).
_RANK_IN_NAME = re.compile(r"(\d+)(?:\.(?:json|pickle|pkl))?$")


@dataclass(frozen=True)
class FREntry:
    pg_name: str
    pg_desc: str
    collective_seq_id: int
    p2p_seq_id: int
    is_p2p: bool
    op: str  # profiling name without the backend prefix: all_reduce, all_gather, broadcast...
    profiling_name: str
    input_sizes: tuple
    output_sizes: tuple
    input_dtypes: tuple[str, ...]
    output_dtypes: tuple[str, ...]
    state: str  # scheduled | started | completed
    time_created_ns: int | None
    time_started_ns: int | None
    time_completed_ns: int | None
    timeout_ms: int | None
    record_id: int | None


@dataclass(frozen=True)
class PGStatus:
    last_enqueued: int | None
    last_started: int | None
    last_completed: int | None


@dataclass(frozen=True)
class PGConfig:
    name: str
    desc: str
    ranks: tuple[int, ...] | None  # global ranks of the members; None when the dump omits them


@dataclass
class FRDump:
    source: str
    rank: int | None
    hostname: str | None
    version: str | None
    comm_lib_version: str | None
    pg_config: dict[str, PGConfig]
    pg_status: dict[str, PGStatus]
    entries: list[FREntry] = field(default_factory=list)
    # When the dump was written (the file's mtime; None for a dump decoded from memory): torch's
    # dump carries no time of its own, and without one an in-flight collective looks stuck.
    written_ns: int | None = None

    def collectives(self, pg_name: str) -> dict[int, FREntry]:
        return {e.collective_seq_id: e for e in self.entries if e.pg_name == pg_name and not e.is_p2p}

    def completed_count(self) -> int:
        return sum(1 for e in self.entries if e.state == "completed")


# ---------------------------------------------------------------- reading


def _as_int(value: Any, what: str, source: str) -> int | None:
    if value is None or value == "":
        return None
    if isinstance(value, bool):
        raise UserError(f"{source}: Flight Recorder field {what} is a boolean, expected an integer")
    try:
        return int(value)
    except (TypeError, ValueError, OverflowError):  # OverflowError: int(float("inf"))
        shown = repr(value) if not isinstance(value, str) or len(value) <= 40 else f"a {len(value)}-character string"
        raise UserError(f"{source}: Flight Recorder field {what} is {shown[:60]}, expected an integer") from None


def _as_ns(value: Any, what: str, source: str) -> int | None:
    ns = _as_int(value, what, source)
    return None if not ns else ns  # JSON dumps write 0 for "not yet"


def _sizes(value: Any, what: str, source: str) -> tuple:
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)):
        raise UserError(f"{source}: Flight Recorder field {what} is {type(value).__name__}, expected a list of shapes")
    out = []
    for shape in value:
        if not isinstance(shape, (list, tuple)) or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
            raise UserError(f"{source}: Flight Recorder field {what} holds {shape!r}, expected a list of integers")
        out.append(tuple(shape))
    return tuple(out)


def _strings(value: Any, what: str, source: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise UserError(f"{source}: Flight Recorder field {what} must be a list of strings")
    return tuple(value)


def _parse_ranks(value: Any) -> tuple[int, ...] | None:
    # torch writes the member list as a string: "[0, 1, 2, 3]".
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return None
    if isinstance(value, (list, tuple)) and all(isinstance(r, int) and not isinstance(r, bool) for r in value):
        return tuple(value)
    return None


def _entry(raw: Any, index: int, source: str) -> FREntry:
    if not isinstance(raw, dict):
        raise UserError(f"{source}: Flight Recorder entry {index} is {type(raw).__name__}, expected a mapping")
    pg = raw.get("process_group") or (str(raw.get("pg_id", "")), "")
    if not isinstance(pg, (list, tuple)) or len(pg) < 1:
        raise UserError(f"{source}: Flight Recorder entry {index} has process_group {pg!r}, expected (name, desc)")
    profiling_name = raw.get("profiling_name") or ""
    if not isinstance(profiling_name, str):
        raise UserError(f"{source}: Flight Recorder entry {index} has a non-text profiling_name")
    seq = _as_int(raw.get("collective_seq_id"), f"entries[{index}].collective_seq_id", source)
    state = raw.get("state") or ""
    return FREntry(
        pg_name=str(pg[0]),
        pg_desc=str(pg[1]) if len(pg) > 1 else "",
        collective_seq_id=-1 if seq is None else seq,
        p2p_seq_id=_as_int(raw.get("p2p_seq_id"), f"entries[{index}].p2p_seq_id", source) or 0,
        is_p2p=bool(raw.get("is_p2p", False)),
        op=profiling_name.split(":", 1)[-1],
        profiling_name=profiling_name,
        input_sizes=_sizes(raw.get("input_sizes"), f"entries[{index}].input_sizes", source),
        output_sizes=_sizes(raw.get("output_sizes"), f"entries[{index}].output_sizes", source),
        input_dtypes=_strings(raw.get("input_dtypes"), f"entries[{index}].input_dtypes", source),
        output_dtypes=_strings(raw.get("output_dtypes"), f"entries[{index}].output_dtypes", source),
        state=str(state),
        time_created_ns=_as_ns(raw.get("time_created_ns"), f"entries[{index}].time_created_ns", source),
        time_started_ns=_as_ns(raw.get("time_discovered_started_ns"), f"entries[{index}].time_discovered_started_ns", source),
        time_completed_ns=_as_ns(raw.get("time_discovered_completed_ns"), f"entries[{index}].time_discovered_completed_ns", source),
        timeout_ms=_as_int(raw.get("timeout_ms"), f"entries[{index}].timeout_ms", source),
        record_id=_as_int(raw.get("record_id"), f"entries[{index}].record_id", source),
    )


def _rank_from(raw: dict, path: Path | None, pg_config: dict[str, PGConfig]) -> int | None:
    if isinstance(raw.get("rank"), int) and not isinstance(raw.get("rank"), bool):
        return raw["rank"]
    if path is not None:
        m = _RANK_IN_NAME.search(path.name)
        if m:
            return int(m.group(1))
    # A world of one (like a single-GPU capture) has only one possible rank.
    members = {r for cfg in pg_config.values() if cfg.ranks for r in cfg.ranks}
    return next(iter(members)) if len(members) == 1 else None


def parse_dump(raw: Any, source: str, path: Path | None = None) -> FRDump:
    """Normalise a decoded dump (pickle or JSON form)."""
    if not isinstance(raw, dict) or not isinstance(raw.get("entries"), list) or not ({"pg_status", "pg_config", "version"} & raw.keys()):
        raise UserError(f"{source}: not a Flight Recorder dump (expected a mapping with 'entries' and 'pg_status')")
    for section in ("pg_config", "pg_status"):
        if raw.get(section) is not None and not isinstance(raw[section], dict):
            raise UserError(f"{source}: Flight Recorder field {section} is a {type(raw[section]).__name__}, expected a mapping")
    if len(raw["entries"]) > MAX_DUMP_ENTRIES:
        raise UserError(f"{source}: {len(raw['entries'])} Flight Recorder entries, more than the {MAX_DUMP_ENTRIES} limit; not analysed")
    pg_config: dict[str, PGConfig] = {}
    for key, cfg in (raw.get("pg_config") or {}).items():
        if isinstance(cfg, dict):
            pg_config[str(key)] = PGConfig(str(cfg.get("name", key)), str(cfg.get("desc", "")), _parse_ranks(cfg.get("ranks")))
    pg_status: dict[str, PGStatus] = {}
    for key, st in (raw.get("pg_status") or {}).items():
        if isinstance(st, dict):
            pg_status[str(key)] = PGStatus(
                _as_int(st.get("last_enqueued_collective"), f"pg_status[{key}].last_enqueued_collective", source),
                _as_int(st.get("last_started_collective"), f"pg_status[{key}].last_started_collective", source),
                _as_int(st.get("last_completed_collective"), f"pg_status[{key}].last_completed_collective", source),
            )
    entries = [_entry(e, i, source) for i, e in enumerate(raw["entries"])]
    hostname = raw.get("hostname") or raw.get("host_name")
    return FRDump(
        source=source,
        rank=_rank_from(raw, path, pg_config),
        hostname=str(hostname) if hostname else None,
        version=str(raw["version"]) if raw.get("version") is not None else None,
        comm_lib_version=str(raw["comm_lib_version"]) if raw.get("comm_lib_version") is not None else None,
        pg_config=pg_config,
        pg_status=pg_status,
        entries=entries,
    )


def _decode(path: Path) -> Any:
    try:
        with path.open("rb") as fh:
            head = fh.read(8)
    except OSError as exc:
        raise UserError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    if looks_like_pickle(head):
        return safe_load(path, max_bytes=MAX_DUMP_BYTES, max_items=MAX_DUMP_ITEMS)
    if head.lstrip()[:1] == b"{":
        if path.stat().st_size > MAX_DUMP_BYTES:
            raise UserError(f"{path}: larger than the {MAX_DUMP_BYTES}-byte limit for a Flight Recorder dump")
        try:
            return json.loads(path.read_bytes())
        except (ValueError, RecursionError) as exc:  # ValueError: bad JSON, bad UTF-8, a 5000-digit integer
            raise UserError(f"{path}: not valid JSON: {str(exc).splitlines()[0][:120]}") from None
    raise UserError(f"{path}: not a Flight Recorder dump (neither a pickle nor JSON)")


def load_dump(path: str | Path) -> FRDump:
    """Read one rank's dump (pickle or JSON form); `UserError` naming the file if it is not one."""
    p = Path(path)
    try:
        dump = parse_dump(_decode(p), str(p), p)
        try:
            dump.written_ns = p.stat().st_mtime_ns
        except OSError:
            pass
        return dump
    except (ValueError, TypeError, AttributeError, OverflowError, RecursionError) as exc:
        # Fields of a shape no torch writes (str() of a 5000-digit integer raises ValueError).
        raise UserError(f"{p}: malformed Flight Recorder dump ({type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''})") from None


def is_flight_recorder_dump(path: str | Path) -> bool:
    """True when the file is a Flight Recorder dump (loads it only when the header fits)."""
    p = Path(path)
    try:
        if not p.is_file():
            return False
        with p.open("rb") as fh:
            head = fh.read(_SNIFF_BYTES)
    except OSError:
        return False
    if looks_like_pickle(head):
        try:
            raw = safe_load(p, max_bytes=MAX_DUMP_BYTES, max_items=MAX_DUMP_ITEMS)
        except UserError:
            return False
        return isinstance(raw, dict) and isinstance(raw.get("entries"), list) and bool({"pg_status", "pg_config"} & raw.keys())
    if head.lstrip()[:1] == b"{":
        return b'"entries"' in head and (b'"pg_status"' in head or b'"pg_config"' in head) or (
            b'"pg_config"' in head and b'"comm_lib_version"' in head
        )
    return False


# ---------------------------------------------------------------- cross-rank analysis


def _members(pg_name: str, pg_desc: str, dumps: Sequence[FRDump]) -> tuple[int, ...] | None:
    for d in dumps:
        cfg = d.pg_config.get(pg_name)
        if cfg is None:
            cfg = next((c for c in d.pg_config.values() if c.desc and c.desc == pg_desc), None)
        if cfg is None and len(d.pg_config) == 1:
            # gloo keys its only (default) group by "" while entries call it "0".
            cfg = next(iter(d.pg_config.values()))
        if cfg is not None and cfg.ranks is not None:
            return cfg.ranks
    return None


def _majority(values: dict[int, Any]) -> Any:
    """The value most ranks hold; ties go to the value held by the lowest rank."""
    counts = Counter(values.values())
    best = max(counts.values())
    return next(values[r] for r in sorted(values) if counts[values[r]] == best)


def _ranks_str(ranks: Iterable[int]) -> str:
    ranks = sorted(ranks)
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


def _ts(entries: Iterable[FREntry]) -> float:
    times = [e.time_created_ns for e in entries if e.time_created_ns]
    return max(times) / 1e9 if times else 0.0


def _node_of(ranks: Iterable[int], by_rank: dict[int, FRDump]) -> tuple[str | None, list[str]]:
    hosts = sorted({by_rank[r].hostname for r in ranks if r in by_rank and by_rank[r].hostname})
    return (hosts[0] if len(hosts) == 1 else None), hosts


def _signature_mismatch(present: dict[int, FREntry]) -> tuple[str, dict[int, Any]] | None:
    checks = (
        ("op", lambda e: e.op),
        ("size", lambda e: (e.input_sizes, e.output_sizes)),
        ("dtype", lambda e: (e.input_dtypes, e.output_dtypes)),
    )
    for kind, key in checks:
        values = {r: key(e) for r, e in present.items()}
        if len(set(values.values())) > 1:
            return kind, values
    return None


def _describe(kind: str, value: Any) -> str:
    if kind == "op":
        return str(value)
    if kind == "size":
        return f"sizes in {[list(s) for s in value[0]]} out {[list(s) for s in value[1]]}"
    return f"dtypes in {list(value[0])} out {list(value[1])}"


def _call(kind: str, op: str, value: Any) -> str:
    return _describe(kind, value) if kind == "op" else f"{op} with {_describe(kind, value)}"


@dataclass
class _Group:
    """One process group as the dumps show it: its members' collectives, by rank and sequence id."""

    name: str
    label: str
    by_rank: dict[int, FRDump]
    per_rank: dict[int, dict[int, FREntry]]
    expected: list[int]
    oldest: dict[int, int | None]
    enqueued: dict[int, int | None]
    newest: dict[int, int]
    common: dict[str, Any]

    def evicted(self, r: int, seq: int) -> bool:
        """A rank's buffer is a ring shared by all its groups: sequence ids below its oldest kept
        entry, or up to the last one its pg_status says it enqueued, were evicted, not missed."""
        oldest, enqueued = self.oldest[r], self.enqueued[r]
        return (oldest is not None and seq < oldest) or (enqueued is not None and seq <= enqueued)


def _group_view(pg_name: str, pg_desc: str, dumps: Sequence[FRDump]) -> _Group | None:
    by_rank = {d.rank: d for d in dumps if d.rank is not None}
    per_rank = {r: d.collectives(pg_name) for r, d in by_rank.items()}
    members = _members(pg_name, pg_desc, dumps)
    expected = sorted(set(members) & by_rank.keys()) if members else sorted(r for r, c in per_rank.items() if c)
    without_dump = sorted(set(members or ()) - by_rank.keys())
    expected = [r for r in expected if r in per_rank]
    if not expected:
        return None
    enqueued = {r: by_rank[r].pg_status[pg_name].last_enqueued if pg_name in by_rank[r].pg_status else None for r in expected}
    return _Group(
        name=pg_name,
        label=pg_name if not pg_desc else f"{pg_name} ({pg_desc})",
        by_rank=by_rank,
        per_rank=per_rank,
        expected=expected,
        oldest={r: min(per_rank[r], default=None) for r in expected},
        enqueued=enqueued,
        newest={r: max(max(per_rank[r], default=0), enqueued[r] or 0) for r in expected},
        common={"pg": pg_name, "pg_desc": pg_desc, "pg_size": len(members) if members else len(expected), "ranks_without_dump": without_dump},
    )


def _never_joined(g: _Group, seq: int, present: dict[int, FREntry], absent: list[int]) -> GroupAnalysis:
    op = _majority({r: e.op for r, e in present.items()})
    node, hosts = _node_of(absent, g.by_rank)
    return GroupAnalysis(
        kind="collective_hang",
        ts=_ts(present.values()),
        ranks=g.expected,
        culprit_ranks=absent,
        node=node,
        evidence={
            **g.common,
            "collective_seq_id": seq,
            "op": op,
            "joined_ranks": len(present),
            "missing_ranks": len(absent),
            "culprit_last_seq": [g.newest[r] for r in absent],
            "culprit_nodes": hosts,
        },
        summary=(
            f"collective #{seq} {op} on process group {g.label}: rank(s) {_ranks_str(absent)} never joined "
            f"({len(present)} of {len(g.expected)} did; the culprits' last collective is "
            f"#{min(g.newest[r] for r in absent)}); the others wait on them"
        ),
        source=g.by_rank[min(present)].source,
    )


def _mismatched(g: _Group, seq: int, present: dict[int, FREntry]) -> GroupAnalysis | None:
    mismatch = _signature_mismatch(present) if len(present) > 1 else None
    if not mismatch:
        return None
    mtype, values = mismatch
    expected_value = _majority(values)
    culprits = sorted(r for r, v in values.items() if v != expected_value)
    odd = sorted({_describe(mtype, values[r]) for r in culprits})
    agreeing = min(r for r in present if r not in culprits)
    node, hosts = _node_of(culprits, g.by_rank)
    return GroupAnalysis(
        kind="collective_mismatch",
        ts=_ts(present.values()),
        ranks=g.expected,
        culprit_ranks=culprits,
        node=node,
        evidence={
            **g.common,
            "collective_seq_id": seq,
            "mismatch_type": mtype,
            "op": present[agreeing].op,
            "expected": _describe(mtype, expected_value),
            "found": odd,
            "culprit_ops": [present[r].op for r in culprits],
            "culprit_nodes": hosts,
        },
        summary=(
            f"collective #{seq} on process group {g.label}: rank(s) {_ranks_str(culprits)} called "
            f"{'; '.join(sorted({_call(mtype, present[r].op, values[r]) for r in culprits}))} where the other "
            f"{len(present) - len(culprits)} rank(s) called {_call(mtype, present[agreeing].op, expected_value)} ({mtype} mismatch)"
        ),
        source=g.by_rank[culprits[0]].source,
    )


def _stuck_everywhere(g: _Group, stuck_after_seconds: float) -> GroupAnalysis | None:
    """Everyone joined everything: is the newest collective stuck on every rank (e.g. a GPU
    kernel that never finishes)? Trust an entry's state, and pg_status where it tracks it."""
    last = max(g.newest.values())
    if last <= 0 or any(last not in g.per_rank[r] for r in g.expected):
        return None
    not_done = []
    last_completed: list[int | None] = []
    for r in g.expected:
        status = g.by_rank[r].pg_status.get(g.name)
        done = status.last_completed if status else None
        last_completed.append(done)
        if g.per_rank[r][last].state != "completed" and done is not None and done < last:
            not_done.append(r)
    if not not_done:
        return None
    # A dump taken while the job runs (on demand, or racing the completion of the last collective,
    # as gloo's real dumps do) shows its newest collective in flight. Only one that was pending
    # for a while before the dump was written is stuck; with no write time, trust the states.
    created = max((g.per_rank[r][last].time_created_ns or 0) for r in g.expected)
    written = max((g.by_rank[r].written_ns or 0) for r in g.expected)
    if created and written and 0 <= written - created < stuck_after_seconds * 1e9:
        return None
    # When every rank is stuck the dump cannot say whose fault it is, unless there is only one.
    culprits = not_done if len(not_done) < len(g.expected) or len(g.expected) == 1 else []
    entry = g.per_rank[not_done[0]][last]
    return GroupAnalysis(
        kind="collective_hang",
        ts=_ts(g.per_rank[r][last] for r in g.expected),
        ranks=g.expected,
        culprit_ranks=culprits,
        node=_node_of(culprits or g.expected, g.by_rank)[0],
        evidence={
            **g.common,
            "collective_seq_id": last,
            "op": entry.op,
            "joined_ranks": len(g.expected),
            "missing_ranks": 0,
            "not_completed_ranks": not_done,
            "last_enqueued": [g.by_rank[r].pg_status[g.name].last_enqueued if g.name in g.by_rank[r].pg_status else None for r in g.expected],
            "last_completed": last_completed,
            "timeout_ms": entry.timeout_ms,
        },
        summary=(
            f"collective #{last} {entry.op} on process group {g.label}: joined by all {len(g.expected)} rank(s) "
            f"but not completed on rank(s) {_ranks_str(not_done)} (last completed #{min(c for c in last_completed if c is not None)}); "
            "stuck in the device or the network, not waiting for a missing rank"
        ),
        source=g.by_rank[not_done[0]].source,
    )


def _analyze_group(pg_name: str, pg_desc: str, dumps: Sequence[FRDump], stuck_after_seconds: float) -> GroupAnalysis | None:
    g = _group_view(pg_name, pg_desc, dumps)
    if g is None:
        return None
    for seq in sorted({s for r in g.expected for s in g.per_rank[r]}):
        present = {r: g.per_rank[r][seq] for r in g.expected if seq in g.per_rank[r]}
        absent = [r for r in g.expected if seq not in g.per_rank[r] and not g.evicted(r, seq)]
        if absent:
            return _never_joined(g, seq, present, absent)
        if (found := _mismatched(g, seq, present)) is not None:
            return found
    return _stuck_everywhere(g, stuck_after_seconds)


def analyze_dumps(dumps: Sequence[FRDump], *, stuck_after_seconds: float = STUCK_AFTER_SECONDS) -> list[GroupAnalysis]:
    """Cross-rank analysis of one job's dumps (one per rank): at most one analysis per group.

    A collective every rank joined counts as stuck only when it had been pending for
    `stuck_after_seconds` when the dumps were written (see `FRDump.written_ns`)."""
    if not dumps:
        return []
    seen: dict[int, str] = {}
    for d in dumps:
        if d.rank is None:
            if len(dumps) > 1:
                raise UserError(f"{d.source}: cannot tell which rank wrote this dump (no 'rank' field and no rank number ending the file name)")
            d.rank = 0
        if d.rank in seen:
            raise UserError(f"{d.source}: a second dump for rank {d.rank} (the first is {seen[d.rank]})")
        seen[d.rank] = d.source
    groups: dict[str, str] = {}
    for d in dumps:
        for e in d.entries:
            groups.setdefault(e.pg_name, e.pg_desc)
    found = []
    for pg_name, pg_desc in sorted(groups.items()):
        analysis = _analyze_group(pg_name, pg_desc, dumps, stuck_after_seconds)
        if analysis is not None:
            found.append(analysis)
    return found


def _expand(paths: Iterable[Path]) -> list[Path]:
    files: list[Path] = []
    for p in paths:
        if p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file() and is_flight_recorder_dump(f))
            if not found:
                raise UserError(f"{p}: no Flight Recorder dumps in this folder")
            files.extend(found)
        elif p.exists():
            files.append(p)
        else:
            raise UserError(f"{p}: no such file or folder")
    return files


def _same_records(a: FRDump, b: FRDump) -> bool:
    key = lambda d: sorted((e.pg_name, e.collective_seq_id, e.op, e.input_sizes) for e in d.entries)  # noqa: E731
    return key(a) == key(b)


def _job_key(path: Path) -> tuple[str, str]:
    # fr_trace's convention: one job's dumps share a folder and a file-name prefix, the rank
    # number ending each name (fr_rank_0, fr_rank_1, ...; .json beside .pickle is the same dump).
    name = re.sub(r"\.(json|pickle|pkl)$", "", path.name)
    return str(path.parent), re.sub(r"\d+$", "", name)


def load_groups(paths: Sequence[str | Path], errors: list[str] | None = None) -> list[list[FRDump]]:
    """Load every dump in files and folders, grouped by job (folder + file-name prefix), each
    group in rank order. The pickle and JSON forms of one rank's dump are one dump (pickle kept).

    With `errors` (a list), a dump that cannot be loaded adds one line there and is left out, and
    the others are still loaded; without it the first such dump raises its `UserError`."""
    groups: dict[tuple[str, str], dict[int | None, FRDump]] = {}
    unranked: dict[tuple[str, str], list[FRDump]] = {}
    for path in _expand(Path(p) for p in paths):
        try:
            dump = load_dump(path)
        except UserError as exc:
            if errors is None:
                raise
            errors.append(str(exc).splitlines()[0] if str(exc) else f"{path}: unreadable")
            continue
        key = _job_key(path)
        if dump.rank is None:
            unranked.setdefault(key, []).append(dump)
            continue
        dumps = groups.setdefault(key, {})
        other = dumps.get(dump.rank)
        if other is None:
            dumps[dump.rank] = dump
        elif _same_records(other, dump):
            if other.source.endswith(".json") and not dump.source.endswith(".json"):
                dumps[dump.rank] = dump
        else:
            raise UserError(f"{dump.source}: a second, different dump for rank {dump.rank} (the first is {other.source})")
    out = []
    for key in sorted(set(groups) | set(unranked)):
        dumps = groups.get(key, {})
        out.append([dumps[r] for r in sorted(r for r in dumps if r is not None)] + unranked.get(key, []))
    return out


def load_paths(paths: Sequence[str | Path]) -> list[FRDump]:
    """All dumps in files and folders as one job (see `load_groups` for several jobs)."""
    groups = load_groups(paths)
    if len(groups) > 1:
        seen: dict[int | None, FRDump] = {}
        for dump in (d for g in groups for d in g):
            if dump.rank in seen and not _same_records(seen[dump.rank], dump):
                raise UserError(f"{dump.source}: a second, different dump for rank {dump.rank} (the first is {seen[dump.rank].source})")
            seen.setdefault(dump.rank, dump)
        return list(seen.values())
    return groups[0] if groups else []
