"""CUDA out-of-memory messages -> `OomReport` (numbers + classification), in the three wordings
PyTorch has used (see `gpuvigil.collectors.nccl_log` for examples). Pure text parsing, no I/O:
shared by the log collectors, `analyze` and the OOM detector.

Each OOM is classified cause first, from what could have served the request (R: request,
F: free on the device, U: PyTorch's reserved-but-unallocated cache, O: memory other processes
are *shown* to hold; thresholds in `gpuvigil/config/oom_classify.yaml`). When the allocator raises,
it has already handed every wholly free cached segment back to the driver and retried: U is what
is left, free pieces of segments still partly in use, so U and F cannot be added up to serve one
request. And not all of F can be handed out: the driver maps memory in pages and needs some for
its own bookkeeping, so free memory serves R only with a headroom H (`driver_headroom_*`).

1. U >= R: PyTorch's own cache had the room, in pieces -> `oom_fragmentation`;
2. F >= R + H: the device had the room free; the figures do not explain the OOM -> `oom_unexplained`;
3. F + O >= R + H: the memory other processes hold made the difference -> `oom_foreign_process`;
4. otherwise nothing on the device could have served it -> `oom_capacity`.

With `torch.cuda.set_per_process_memory_fraction` torch 1.x prints "X allowed": F is then at most
what the fraction leaves this process (X minus its reservation).

Memory that is neither free nor PyTorch's is not another process by default: it holds the CUDA
context and libraries' workspaces (0.3-1.5 GiB). Other processes count only where the message
shows them: `Process N has X memory in use` clauses, minus the one that is this process (the
one equal to `this process has X` when that figure covers PyTorch's reservation; else, in
containers where NVML reports `this process has 0 bytes`, the smallest one that covers it).
ROCm builds print the same messages with `HIP` for `CUDA`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from gpuvigil import config
from gpuvigil.model import FindingKind

_UNITS = {"b": 1, "bytes": 1, "byte": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40, "kb": 1 << 10, "mb": 1 << 20, "gb": 1 << 30}
# At most 15 digits: a longer run is not a memory size (and would overflow to infinity).
_SIZE = r"(\d{1,15}(?:\.\d{1,15})?)\s*(bytes?|[KMGT]iB|[KMGT]B|B)"


_OOM_HEAD = re.compile(r"(?:CUDA|HIP) out of memory\. Tried to allocate " + _SIZE, re.IGNORECASE)
# Where a head starts, found before whitespace is normalised (a logger may wrap inside it).
_OOM_HEAD_START = re.compile(r"(?:CUDA|HIP)\s+out\s+of\s+memory\.\s+Tried\s+to\s+allocate\s", re.IGNORECASE)
# An OOM message with every "Process N has ..." line of a crowded GPU fits in far less.
_OOM_MAX_CHARS = 64 * 1024
def _size(name: str) -> str:
    return rf"(?P<{name}>\d{{1,15}}(?:\.\d{{1,15}})?)\s*(?P<{name}_unit>bytes?|[KMGT]iB|[KMGT]B|B)"


_OOM_OLD = re.compile(
    r"\(GPU (?P<gpu>\d+); " + _size("total") + r" total capacity; " + _size("allocated") + r" already allocated; " + _size("free") + r" free;"
    # torch.cuda.set_per_process_memory_fraction adds "X allowed;"
    r"(?: " + _size("allowed") + r" allowed;)?"
    # torch ≤1.3 said "cached" for what later releases call "reserved in total by PyTorch"
    r"(?: " + _size("reserved") + r" (?P<what>reserved in total by PyTorch|cached))?"
)
_OOM_NEW = re.compile(r"GPU (?P<gpu>\d+) has a total capac(?:i)?ty of " + _SIZE + r" of which " + _SIZE + r" is free\.")
_OOM_THIS_PROC = re.compile(r"this process has " + _SIZE + r" memory in use")
_OOM_PROC = re.compile(r"Process (?P<pid>\d+) has " + _SIZE + r" memory in use")
_OOM_SPLIT = re.compile(r"Of the allocated memory " + _SIZE + r" is allocated by PyTorch, and " + _SIZE + r" is reserved by PyTorch but unallocated")



def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / (1 << 30):.2f} GiB"


def _bytes(value: str, unit: str) -> int:
    return int(round(float(value) * _UNITS[unit.lower()]))


class OomClassifyConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # A "Process N has X" clause within this of "this process has X" is this process listed by
    # NVML (containers), not another one. The message prints two decimals, so 10 MiB is rounding.
    same_process_tolerance_bytes: int = Field(10 << 20, ge=0)
    # Other processes holding less than this are not reported as the cause (noise, e.g. a
    # monitoring agent's context), whatever the arithmetic says.
    foreign_min_bytes: int = Field(64 << 20, ge=0)
    # Free memory serves a request only with this much to spare: the larger of the two.
    driver_headroom_bytes: int = Field(64 << 20, ge=0)
    driver_headroom_fraction: float = Field(0.01, ge=0, le=1)

    def headroom(self, requested: int) -> int:
        return max(self.driver_headroom_bytes, int(self.driver_headroom_fraction * requested))


def load_oom_config(cfg: dict[str, Any] | None = None) -> OomClassifyConfig:
    return config.section("oom_classify", OomClassifyConfig, cfg)


@dataclass
class OomReport:
    line: int
    ts: float
    rank: int | None
    gpu: int | None
    requested_bytes: int
    total_bytes: int | None = None
    free_bytes: int | None = None
    process_used_bytes: int | None = None
    allocated_bytes: int | None = None
    reserved_unallocated_bytes: int | None = None
    other_processes: list[dict[str, int]] = field(default_factory=list)
    wording: str = "new"  # old | capacty | new
    text: str = ""
    # "this process has X" covers PyTorch's reservation (X is believable, not a container artefact)
    process_used_credible: bool = False
    # torch 1.x with a per-process memory fraction: "X allowed"
    allowed_bytes: int | None = None

    def foreign_bytes(self) -> int | None:
        """Device memory the message shows other processes holding (0 when it lists none; None
        when it carries no figures at all)."""
        if self.free_bytes is None and not self.other_processes:
            return None
        return sum(p["bytes"] for p in self.other_processes)

    def non_pytorch_bytes(self) -> int | None:
        """Memory neither free nor PyTorch's: CUDA context, libraries, and any other process."""
        if self.total_bytes is None or self.free_bytes is None or self.allocated_bytes is None:
            return None
        return max(0, self.total_bytes - self.free_bytes - self.allocated_bytes - (self.reserved_unallocated_bytes or 0))

    def usable_free_bytes(self) -> int | None:
        """Free memory this process could have had: F, capped by a memory fraction's allowance."""
        if self.free_bytes is None or self.allowed_bytes is None:
            return self.free_bytes
        ours = (self.allocated_bytes or 0) + (self.reserved_unallocated_bytes or 0)
        return max(0, min(self.free_bytes, self.allowed_bytes - ours))

    def classify(self, cfg: OomClassifyConfig | None = None) -> FindingKind:
        """Cause first: what on the device could have served the request (module docstring)."""
        cfg = cfg or load_oom_config()
        free = self.usable_free_bytes()
        if free is None:
            return FindingKind.OOM_UNEXPLAINED  # no figures to reason from (truncated message)
        r = self.requested_bytes
        need = r + cfg.headroom(r)
        others = self.foreign_bytes() or 0
        if others < cfg.foreign_min_bytes:
            others = 0
        if (self.reserved_unallocated_bytes or 0) >= r:
            return FindingKind.OOM_FRAGMENTATION
        if free >= need:
            return FindingKind.OOM_UNEXPLAINED
        if free + others >= need:
            return FindingKind.OOM_FOREIGN_PROCESS
        return FindingKind.OOM_CAPACITY

    def reason(self, kind: FindingKind) -> str:
        """One sentence saying why, with the figures."""
        g = _gib
        r, free, unalloc = self.requested_bytes, self.usable_free_bytes(), self.reserved_unallocated_bytes or 0
        capped = f" (of {g(self.free_bytes)} free, the memory fraction leaves {g(free)})" if free != self.free_bytes else ""
        if kind == FindingKind.OOM_CAPACITY:
            if self.total_bytes is not None and r > self.total_bytes:
                return f"the request alone ({g(r)}) exceeds the device ({g(self.total_bytes)})"
            cache = f"PyTorch's cache holds only {g(unalloc)}" if unalloc else "PyTorch caches nothing unallocated"
            short = " (within the headroom the driver keeps)" if free is not None and free >= r else ""
            return f"nothing on the device could have served {g(r)}: {g(free)} free{capped}{short} and {cache}" + (
                f"; {g(self.foreign_bytes())} held by other processes would not have made the room" if self.foreign_bytes() else "")
        if kind == FindingKind.OOM_FRAGMENTATION:
            return f"PyTorch's cache held {g(unalloc)} reserved but unallocated, enough for {g(r)} had it been contiguous"
        if kind == FindingKind.OOM_FOREIGN_PROCESS:
            return f"{g(self.foreign_bytes())} held by other processes made the difference ({g(free)} free{capped} < {g(r)})"
        if free is None:
            return "the message carries no free-memory figure to explain it"
        return f"the figures do not explain it: {g(free)} was free{capped} for a request of {g(r)} (another allocator, a memory fraction limit or MIG/MPS limits may be involved)"

    def key(self) -> tuple:
        return (self.rank, self.gpu, self.requested_bytes, self.total_bytes, self.free_bytes, self.allocated_bytes, self.reserved_unallocated_bytes)


def parse_oom(text: str, *, line: int = 0, ts: float = 0.0, rank: int | None = None) -> OomReport | None:
    """The numbers of one CUDA OOM message (any of the three wordings), or None."""
    # Loggers wrap long messages at word boundaries and tracebacks put clauses on lines of their
    # own: read the message as one line, or a wrapped "(GPU 0; ... free; ..." or "Process N has
    # X memory in use" clause loses its figures (and the OOM its cause).
    # Every clause follows the head, so only a bounded stretch from the head is normalised: a
    # runaway line from a hostile log is not copied whole.
    start = _OOM_HEAD_START.search(text)
    if not start:
        return None
    text = " ".join(text[start.start() : start.start() + _OOM_MAX_CHARS].split())
    head = _OOM_HEAD.match(text)
    if not head:
        return None
    rep = OomReport(line=line, ts=ts, rank=rank, gpu=None, requested_bytes=_bytes(head[1], head[2]), text=text[:800])
    if m := _OOM_OLD.search(text):
        size = lambda name: _bytes(m[name], m[f"{name}_unit"])  # noqa: E731
        rep.wording = "old"
        rep.gpu = int(m["gpu"])
        rep.total_bytes = size("total")
        rep.allocated_bytes = size("allocated")
        rep.free_bytes = size("free")
        if m["allowed"] is not None:
            rep.allowed_bytes = size("allowed")
        if m["reserved"] is not None:
            amount = size("reserved")
            # torch ≤1.3's "cached" is what the cache holds beyond live tensors; later releases
            # give the whole reservation.
            rep.reserved_unallocated_bytes = amount if m["what"] == "cached" else max(0, amount - rep.allocated_bytes)
        return rep
    if m := _OOM_NEW.search(text):
        g = m.groups()
        rep.wording = "capacty" if "capacty" in m.group(0) else "new"
        rep.gpu = int(g[0])
        rep.total_bytes = _bytes(g[1], g[2])
        rep.free_bytes = _bytes(g[3], g[4])
    if m := _OOM_THIS_PROC.search(text):
        rep.process_used_bytes = _bytes(m[1], m[2])
    procs = [{"pid": int(p["pid"]), "bytes": _bytes(p[2], p[3])} for p in _OOM_PROC.finditer(text)]
    if m := _OOM_SPLIT.search(text):
        rep.allocated_bytes = _bytes(m[1], m[2])
        rep.reserved_unallocated_bytes = _bytes(m[3], m[4])
    ours = (rep.allocated_bytes or 0) + (rep.reserved_unallocated_bytes or 0)
    credible = rep.process_used_bytes is not None and rep.process_used_bytes >= ours
    rep.process_used_credible = credible
    if procs:
        tolerance = load_oom_config().same_process_tolerance_bytes
        if credible:
            # NVML may list this process among the others (same figure): it is not another one.
            procs = [p for p in procs if abs(p["bytes"] - rep.process_used_bytes) > tolerance]  # type: ignore[operator]
        else:
            # In a container NVML's pids are not ours and "this process has 0 bytes" is an
            # artefact: the smallest listed process that covers PyTorch's reservation is us.
            candidates = [p for p in procs if p["bytes"] >= ours]
            if candidates:
                me = min(candidates, key=lambda p: p["bytes"] - ours)
                if rep.process_used_bytes is None or rep.process_used_bytes < ours:
                    rep.process_used_bytes = me["bytes"]
                procs = [p for p in procs if p is not me]
    rep.other_processes = procs
    return rep
