"""What travels on NATS and how: subjects, streams, buckets, and the wire form of rows and findings.

Subjects (prefix `gv` by default):

- `gv.rows.<job>`: an agent's rows of one job for one tick (Arrow IPC frames, one per stream). The
  server's subject mapping `gv.rows.*` → `gv.part.{{partition(N,1)}}.{{wildcard(1)}}` rewrites it
  before the stream stores it, so every row of a job lands in one partition whichever node sent it
  (`nats_mapping` writes the line; `partition_of` is the same FNV-1a hash, for tests and tools).
  With `fleet.rows_streams: N > 1` the partitions are spread over N rows streams
  (`GV_ROWS_<k>` holds partitions p with p % N == k), so no one stream leader takes every write.
- `gv.findings.node.<node>` / `gv.findings.part.<p>`: the active findings of an agent or of a
  detect partition, republished on change and every `findings_refresh_seconds`.
- `gv.cluster.node.<node>`: each agent's node summary (its node row, its GPUs' allocations and,
  from an agent that reads the scheduler's queue, the pending jobs), on change and every
  `cluster_refresh_seconds`; the stream keeps the last one per node. The act leader runs
  `fragmentation_cluster`, the one detector that needs every node, over their union.
- `gv.fr.request.<node>`: detect asks the agent of a node holding ranks of a job it suspects of
  a hang to write the job's Flight Recorder debug-info pipes (core NATS, not stored: a request is
  worth something only now, and the trigger asks again while the suspicion lasts).
- `gv.clock.<node>`: each agent's tick time (core NATS, not stored). Detect and act tick on the
  fleet's data clock, so the simulator and real nodes run the same code.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import logging
import re
from typing import Any

import polars as pl

from gpuvigil import schemas
from gpuvigil.config.deploy import Fleet
from gpuvigil.model import Finding

log = logging.getLogger("gpuvigil.fleet")

# Job-level streams an agent ships (the job-scope detectors read these), and the snapshots of the
# job's placement that go with them.
ROW_STREAMS = ("rank_progress", "allocator_stats", "gpu_samples", "events", "gpu_processes", "collective_progress", "fr_analysis", "fr_pipes")
SNAPSHOT_STREAMS = ("allocations", "jobs")
_TOKEN_OK = re.compile(r"^[A-Za-z0-9_-]{1,200}$")


def token(name: str) -> str:
    """A NATS subject token for a job or node name: kept as is when safe, else made safe with a
    digest suffix so two names never share a token."""
    if _TOKEN_OK.match(name):
        return name
    safe = re.sub(r"[^A-Za-z0-9_-]", "_", name)[:160]
    return f"{safe}~{hashlib.sha1(name.encode()).hexdigest()[:10]}".replace("~", "_x")


def fnv1a32(data: bytes) -> int:
    h = 0x811C9DC5
    for b in data:
        h = ((h ^ b) * 0x01000193) & 0xFFFFFFFF
    return h


def partition_of(job: str, partitions: int) -> int:
    """The partition nats-server's `{{partition(N,1)}}` picks for this job's subject token."""
    return fnv1a32(token(job).encode()) % partitions


class Subjects:
    def __init__(self, fleet: Fleet):
        p = fleet.prefix
        self.prefix = p
        self.n_rows_streams = fleet.rows_streams
        self.partitions = fleet.partitions
        self.rows_stream = self.rows_stream_of(0)
        self.cluster_stream = f"{p.upper()}_CLUSTER"
        self.findings_stream = f"{p.upper()}_FINDINGS"
        self.leases_bucket = f"{p}_leases"
        self.ledger_bucket = f"{p}_act_ledger"
        self.state_bucket = f"{p}_{fleet.state_bucket}"

    def rows_stream_of(self, partition: int) -> str:
        """The rows stream that stores `partition` (deterministic: p % rows_streams)."""
        if self.n_rows_streams == 1:
            return f"{self.prefix.upper()}_ROWS"
        return f"{self.prefix.upper()}_ROWS_{partition % self.n_rows_streams}"

    def rows_streams(self) -> dict[str, list[str]]:
        """stream name → the partition subjects it stores."""
        if self.n_rows_streams == 1:
            return {self.rows_stream_of(0): [f"{self.prefix}.part.>"]}
        out: dict[str, list[str]] = {}
        for p in range(self.partitions):
            out.setdefault(self.rows_stream_of(p), []).append(self.part(p))
        return out

    def cluster_node(self, node: str) -> str:
        return f"{self.prefix}.cluster.node.{token(node)}"

    def rows(self, job: str) -> str:
        return f"{self.prefix}.rows.{token(job)}"

    def part(self, partition: int) -> str:
        return f"{self.prefix}.part.{partition}.>"

    def partition_from_subject(self, subject: str) -> int:
        return int(subject.split(".")[2])

    def findings_node(self, node: str) -> str:
        return f"{self.prefix}.findings.node.{token(node)}"

    def findings_part(self, partition: int) -> str:
        return f"{self.prefix}.findings.part.{partition}"

    def fr_request(self, node: str) -> str:
        return f"{self.prefix}.fr.request.{token(node)}"

    def clock(self, node: str) -> str:
        return f"{self.prefix}.clock.{token(node)}"


def nats_mapping(fleet: Fleet) -> str:
    """The nats-server config line that partitions job subjects (account-level subject mapping)."""
    p = fleet.prefix
    return f'mappings = {{ "{p}.rows.*": "{p}.part.{{{{partition({fleet.partitions},1)}}}}.{{{{wildcard(1)}}}}" }}'


# -- rows on the wire ------------------------------------------------------------------------------
def encode_frames(frames: dict[str, pl.DataFrame]) -> tuple[bytes, str]:
    """Frames → one body (Arrow IPC streams back to back) and the index header 'name:offset:len,…'."""
    body = io.BytesIO()
    index = []
    for name, df in frames.items():
        start = body.tell()
        df.write_ipc_stream(body, compression="lz4")
        index.append(f"{name}:{start}:{body.tell() - start}")
    return body.getvalue(), ",".join(index)


def decode_frames(body: bytes, index: str) -> dict[str, pl.DataFrame]:
    out: dict[str, pl.DataFrame] = {}
    for item in filter(None, index.split(",")):
        name, start, length = item.rsplit(":", 2)
        if name not in schemas.STREAMS:
            continue  # a newer agent's stream this replica does not know: skip, never fail
        a, n = int(start), int(length)
        out[name] = pl.read_ipc_stream(io.BytesIO(body[a : a + n]))
    return out


# -- a partition's carried-over state (detect's state bucket) --------------------------------------
def encode_state(stamps: dict[str, Any], state: dict[str, Any]) -> bytes:
    """`Pipeline.carry_over()` with the writer's stamps → one KV value: '<header length>\n', a JSON
    header (stamps, findings, the frames' index), then the detectors' frames (Arrow IPC)."""
    frames = {f"{det}/{name}": df for det, own in state.get("detectors", {}).items() for name, df in own.items()}
    body, index = encode_frames(frames)
    head = json.dumps({**stamps, "now": state.get("now"), "findings": state.get("findings", []), "frames": index}, sort_keys=True).encode()
    return b"%d\n" % len(head) + head + body


def decode_state(data: bytes) -> tuple[dict[str, Any], dict[str, Any]]:
    """A KV value of `encode_state` → (its stamps and findings, the `Pipeline.restore` state).
    Raises ValueError (or an Arrow error) on anything else: the bucket is writable by any detect
    replica, of any version."""
    size, sep, rest = data.partition(b"\n")
    if not sep or not size.isdigit() or int(size) > len(rest):
        raise ValueError("not a partition state snapshot")
    doc = json.loads(rest[: int(size)])
    if not isinstance(doc, dict) or not isinstance(doc.get("findings", []), list):
        raise ValueError("not a partition state snapshot")
    body = rest[int(size) :]
    detectors: dict[str, dict[str, pl.DataFrame]] = {}
    for item in filter(None, str(doc.pop("frames", "")).split(",")):
        name, start, length = item.rsplit(":", 2)
        det, _, own = name.partition("/")
        a, n = int(start), int(length)
        if a < 0 or n < 0 or a + n > len(body):
            raise ValueError(f"frame {name} outside the snapshot")
        detectors.setdefault(det, {})[own] = pl.read_ipc_stream(io.BytesIO(body[a : a + n]))
    return doc, {"now": doc.get("now"), "findings": doc.get("findings", []), "detectors": detectors}


def findings_payload(origin: str, now: float, findings: list[Finding], **extra: Any) -> bytes:
    return json.dumps({"origin": origin, "now": now, "findings": [f.to_json_dict() for f in findings], **extra}, sort_keys=True).encode()


def parse_findings(data: bytes) -> tuple[dict[str, Any], list[Finding]]:
    doc = json.loads(data)
    found = []
    for d in doc.get("findings", []):
        d = dict(d)
        d.pop("id", None)
        found.append(Finding.model_validate(d))
    return doc, found


# -- connection and set-up ---------------------------------------------------------------------------
async def shutdown(nc: Any, *steps: Any, seconds: float = 2.0) -> None:
    """A stop that fits systemd's and Kubernetes' grace: the given coroutines (lease releases) at
    once and bounded, then a bounded flush and a close. `drain` waited for every pull
    subscription (30 s by default) and a release to an unreachable NATS took the request timeout
    each; a lease not released expires after its TTL anyway."""
    if steps:
        try:
            await asyncio.wait_for(asyncio.gather(*steps, return_exceptions=True), seconds)
        except TimeoutError:
            log.info("shutdown: lease releases cut short after %gs (they expire on their own)", seconds)
    try:
        await nc.flush(timeout=1)
    except Exception:  # noqa: BLE001 - NATS gone: nothing to flush to
        pass
    try:
        await asyncio.wait_for(nc.close(), seconds)
    except Exception:  # noqa: BLE001 - closing anyway
        pass


async def ensure(js: Any, fleet: Fleet, *, attempts: int = 60) -> None:
    """Create the streams and buckets (idempotent). A freshly started cluster elects its meta
    leader first: retried for up to `attempts` × 0.5 s."""
    from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig

    s = Subjects(fleet)
    configs = [
        StreamConfig(name=name, subjects=subjects, retention=RetentionPolicy.LIMITS, max_age=fleet.rows_max_age_seconds, max_bytes=fleet.rows_max_bytes,
                     storage=StorageType.FILE, num_replicas=fleet.replicas, discard=DiscardPolicy.OLD, duplicate_window=min(120.0, fleet.rows_max_age_seconds))
        for name, subjects in s.rows_streams().items()
    ] + [
        # The last summary of every node: a new act leader reads the cluster's state at once.
        StreamConfig(name=s.cluster_stream, subjects=[f"{s.prefix}.cluster.>"], retention=RetentionPolicy.LIMITS, max_age=max(600.0, 4 * fleet.findings_stale_seconds),
                     max_msgs_per_subject=1, storage=StorageType.FILE, num_replicas=fleet.replicas, discard=DiscardPolicy.OLD),
        StreamConfig(name=s.findings_stream, subjects=[f"{s.prefix}.findings.>"], retention=RetentionPolicy.LIMITS, max_age=3600.0,
                     max_msgs_per_subject=1000, storage=StorageType.FILE, num_replicas=fleet.replicas, discard=DiscardPolicy.OLD),
    ]
    from nats.js.errors import NotFoundError

    rows = s.rows_streams()
    # The rows streams of another `rows_streams` (their subjects overlap ours): say so, once.
    other = [f"{s.prefix.upper()}_ROWS"] if fleet.rows_streams > 1 else [f"{s.prefix.upper()}_ROWS_0"]
    last: Exception | None = None
    for _ in range(attempts):
        try:
            for name in [*other, *rows]:
                try:
                    info = await js.stream_info(name)
                except NotFoundError:
                    continue
                if name not in rows or sorted(info.config.subjects or []) != sorted(rows[name]):
                    from gpuvigil.errors import UserError

                    raise UserError(f"rows stream {name} was made for another fleet.rows_streams (subjects {info.config.subjects}); "
                                    f"delete the {s.prefix.upper()}_ROWS* streams (they hold only rows_max_age_seconds of rows) and start again")
            for cfg in configs:
                try:
                    info = await js.stream_info(cfg.name)
                except NotFoundError:
                    await js.add_stream(cfg)
                    continue
                await apply_limits(js, info.config, {"max_age": cfg.max_age, "max_bytes": cfg.max_bytes or -1, "num_replicas": cfg.num_replicas},
                                   "fleet.rows_max_age_seconds / rows_max_bytes / replicas" if cfg.name in rows else "fleet.replicas")
            # A partition's state snapshot older than the rows stream describes rows nobody can
            # replay any more: it expires with them.
            for bucket, ttl in ((s.leases_bucket, fleet.lease_ttl_seconds), (s.ledger_bucket, 0.0), (s.state_bucket, fleet.rows_max_age_seconds)):
                try:
                    info = await js.stream_info(f"KV_{bucket}")
                except NotFoundError:
                    await js.create_key_value(bucket=bucket, ttl=ttl or None, history=1, replicas=fleet.replicas)
                    continue
                # A bucket's TTL is its stream's max_age: a changed lease_ttl_seconds is applied
                # to the bucket in place (create_key_value would refuse the other config).
                await apply_limits(js, info.config, {"max_age": ttl, "num_replicas": fleet.replicas},
                                   {s.leases_bucket: "fleet.lease_ttl_seconds / replicas", s.state_bucket: "fleet.rows_max_age_seconds / replicas"}.get(bucket, "fleet.replicas"))
            return
        except Exception as exc:  # noqa: BLE001 - JetStream not ready yet (no meta leader): retry
            from gpuvigil.errors import UserError

            if isinstance(exc, UserError):
                raise
            last = exc
            await asyncio.sleep(0.5)
    raise RuntimeError(f"JetStream set-up failed: {last}")


def _differs(have: Any, want: Any) -> bool:
    if isinstance(want, float) or isinstance(have, float):
        return abs(float(have or 0.0) - float(want or 0.0)) > 1e-3
    return (have if have is not None else -1) != want


async def apply_limits(js: Any, have: Any, want: dict[str, Any], setting: str) -> None:
    """Bring an existing stream's limits (age, bytes, replicas) to the config's, in place; a
    server that cannot (too few nodes for the replicas, a limit over the account's) is one line
    naming the stream and the setting."""
    import dataclasses

    from nats.js.errors import APIError

    from gpuvigil.errors import UserError

    diffs = {k: v for k, v in want.items() if _differs(getattr(have, k), v)}
    if not diffs:
        return
    was = {k: getattr(have, k) for k in diffs}
    try:
        await js.update_stream(dataclasses.replace(have, **diffs))
    except APIError as exc:
        if exc.code == 503:  # no stream or meta leader yet: the caller retries
            raise
        raise UserError(f"stream {have.name}: cannot apply {setting} ({_limits_text(was)} -> {_limits_text(diffs)}): {exc.description or exc}") from None
    log.warning("stream %s: limits changed to the config's: %s -> %s", have.name, _limits_text(was), _limits_text(diffs))


def _limits_text(limits: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in sorted(limits.items()))
