"""`gpuvigil detect`: the job-level detectors (hang, straggler, cross-rank OOM and Flight Recorder
analysis, ...), sharded by job partition.

Each replica keeps a membership key and leases partitions (`part.<p>` in the leases bucket) up to
its fair share, ceil(partitions / live replicas). For every partition it holds it runs one
`Pipeline` with the detectors `serve` runs (minus the node-scope ones, which run in the agents),
fed by a durable pull consumer on `gv.part.<p>.>` of the rows stream that stores p
(`Subjects.rows_stream_of`: `GV_ROWS`, or `GV_ROWS_<p % rows_streams>`). Taking a partition (at start or from a replica
whose lease expired) recreates that consumer from `now - replay_seconds`: the stream is the state,
and the partition's windows are rebuilt from it before its first findings are published. What a
replay cannot rebuild (a hang that began before it, a finding's first report and incident) the
holder snapshots every `state_snapshot_seconds` and on a clean handover into the KV bucket
`<prefix>_<state_bucket>` (key `part.<p>`, fenced by the lease epoch), and the next owner
restores it before it judges the replay (`Pipeline.carry_over` / `restore`). The
active findings of each partition go to `gv.findings.part.<p>`. Each partition's Pipeline comes
from the composition root (app/compose.py, role `detect`) with serve's Flight Recorder trigger,
whose requests go to the agents of the nodes holding the suspected job's ranks
(`gv.fr.request.<node>`). `--metrics-port` serves
/metrics (gpuvigil.fleet.metrics: partitions, leases, messages and rows per stream, lag).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import socket
import threading
import time
from datetime import UTC, datetime
from typing import Any

import polars as pl

from gpuvigil import schemas
from gpuvigil.fleet import connection, transport
from gpuvigil.fleet.agent import add_common, add_metrics_args, install_signals, load
from gpuvigil.fleet.lease import Leases
from gpuvigil.fleet.clock import from_fleet as clock_of
from gpuvigil.fleet.transport import Subjects

log = logging.getLogger("gpuvigil.fleet")
NAME = "detect"
SNAPSHOT_STALE_SECONDS = 60.0  # a job's placement not refreshed for this long (data time) is gone


def add_parser(sub) -> None:
    p = sub.add_parser(NAME, help="job-level detectors over leased job partitions of the NATS rows stream")
    add_common(p, NAME)
    p.add_argument("--id", help="replica id (default: hostname-pid)")
    add_metrics_args(p)
    p.set_defaults(func=run)


class Feed:
    """The collector of one partition's Pipeline: the rows received since the last tick, and the
    union of the latest placement snapshot per (job, node) (several agents send parts of one job)."""

    name = "fleet"
    streams = {s: schemas.STREAMS[s] for s in (*transport.ROW_STREAMS, *transport.SNAPSHOT_STREAMS)}

    def __init__(self) -> None:
        self.errors = 0
        self.future = 0  # messages stamped too far ahead of the clock, ignored
        self.pending: dict[str, list[pl.DataFrame]] = {}
        self.alloc: dict[tuple[str, str], tuple[float, pl.DataFrame]] = {}
        self.jobs: dict[str, tuple[float, pl.DataFrame]] = {}
        self.changed = False
        self.rows = 0

    def add(self, frames: dict[str, pl.DataFrame], node: str, job: str, now: float) -> None:
        for stream, df in frames.items():
            if stream == "allocations":
                self.alloc[(job, node)] = (now, df)
                self.changed = True
            elif stream == "jobs":
                self.jobs[job] = (now, df)
                self.changed = True
            else:
                self.pending.setdefault(stream, []).append(df)
                self.rows += df.height

    def collect(self, now: float) -> dict[str, pl.DataFrame]:
        out = {s: pl.concat(parts, how="vertical_relaxed") for s, parts in self.pending.items() if parts}
        self.pending = {}
        cutoff = now - SNAPSHOT_STALE_SECONDS
        stale = [k for k, (t, _) in self.alloc.items() if t < cutoff]
        for k in stale:
            del self.alloc[k]
        for k in [j for j, (t, _) in self.jobs.items() if t < cutoff]:
            del self.jobs[k]
        if self.changed or stale:
            self.changed = False
            out["allocations"] = pl.concat([df for _, df in self.alloc.values()], how="vertical_relaxed") if self.alloc else schemas.empty("allocations")
            out["jobs"] = pl.concat([df for _, df in self.jobs.values()], how="vertical_relaxed") if self.jobs else schemas.empty("jobs")
        return out


def job_nodes(window: Any, job: str) -> list[str]:
    """The nodes holding a rank of `job`: its placement rows and the nodes its ranks' debug-info
    pipes were seen on."""
    nodes: set[str] = set()
    for stream in ("allocations", "fr_pipes"):
        df = window.get(stream)
        if df.height and "node" in df.columns:
            nodes.update(n for n in df.filter(pl.col("job") == job)["node"].unique().to_list() if n)
    return sorted(nodes)


class Partition:
    """A held partition: its Pipeline, its feed and its consumer."""

    def __init__(self, p: int, pipeline: Any, feed: Feed):
        self.p = p
        self.pipeline = pipeline
        self.feed = feed
        self.sub: Any = None
        self.last_seq = 0
        self.caught_up = False
        self.task: asyncio.Task | None = None
        self.published: tuple[str, ...] | None = None
        self.published_at = float("-inf")
        self.messages = 0
        self.taken_wall = time.monotonic()
        self.caught_up_wall: float | None = None
        self.pending = 0  # the consumer's num_pending at the last fetch (its lag in messages)
        self.newest_now = float("-inf")  # the newest data time read
        self.epoch: int | None = None  # the lease's fencing token (Leases.epoch) stamped on what it publishes
        self.target_seq: int | None = None  # the stream's last sequence when it was taken: the replay reads up to it at least
        self.claimed_at = float("-inf")  # data time of the last claim published while catching up
        self.state_at = float("-inf")  # data time of the last state snapshot taken
        self.state_rev = 0  # the state bucket's revision of part.<p> last read or written by us (0: none)
        self.state_body: tuple[int | None, bytes] | None = None  # a snapshot (epoch, value) not written yet
        # Until its state snapshot has been read: no claim yet, so that the previous owner's last
        # findings message is still the newest on the partition's subject when it is judged.
        self.restoring = True


class Detect:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.cfg, self.fleet = load(args)
        self.id = args.id or f"{socket.gethostname()}-{os.getpid()}"
        self.subjects = Subjects(self.fleet)
        self.clock = clock_of(self.fleet)
        self.parts: dict[int, Partition] = {}
        self.stop_event = asyncio.Event()
        self.last_tick = float("-inf")
        from gpuvigil.pipeline.core import PipelineConfig
        from gpuvigil import config

        self.tick_seconds = config.section("pipeline", PipelineConfig, self.cfg).tick_seconds
        self.ticks = 0
        self.tick_cpu_seconds = 0.0
        # For /metrics (gpuvigil.fleet.metrics.detect_families).
        self.leases: Leases | None = None
        self.partitions_taken = 0
        self.partitions_lost = 0
        self.stream_messages: dict[str, int] = {}
        self.stream_rows: dict[str, int] = {}
        self.findings_published = 0
        self.fenced = 0  # messages not published: the lease was no longer valid (or taken) when they were ready
        self.state_kv: Any = None
        # Ticks (a worker thread) and handover snapshots read and change the partitions' pipelines.
        self.tick_lock = threading.Lock()
        self.state_saving: asyncio.Task | None = None
        self.state_written = 0
        self.state_fenced = 0  # snapshots not written: the lease was lost, or a newer owner wrote one
        self.state_restored = 0
        self.state_ignored: dict[str, int] = {}  # reason → snapshots found at takeover and not restored
        self.state_trimmed = 0  # snapshots over state_max_bytes, written with the findings only
        self.metrics_port: int | None = None
        self._asks: list[tuple[str, str]] = []  # (job, node) the partition being ticked asks dumps of
        self.dump_requests: list[tuple[int, int | None, str, bytes]] = []  # (partition, epoch, subject, body) to publish
        self.dumps_asked = 0

    def _pipeline(self) -> tuple[Any, Feed]:
        from gpuvigil.app import compose

        feed = Feed()
        held: list[Any] = []

        def ask(job: str) -> bool:
            # The trigger's writer: a request to each node that holds a rank of the job; its
            # agent writes the pipes (the partition's tick publishes them, `dump_requests`).
            nodes = job_nodes(held[0].window, job)
            self._asks.extend((job, node) for node in nodes)
            return bool(nodes)

        pipeline = compose.build(self.cfg, NAME, [feed], fleet=self.fleet, dump_ask=ask)
        held.append(pipeline)
        return pipeline, feed

    # -- leases ----------------------------------------------------------------------------------
    async def balance(self, leases: Leases) -> None:
        """Renew what we hold, then grow or shrink to the fair share."""
        await self.renew(leases)
        await self.rebalance(leases)

    async def renew(self, leases: Leases) -> None:
        """Renew what we hold; drop a partition only on a definite answer that another holds it."""
        me = f"member.{self.id}"
        held = list(self.parts)
        # All renewals at once: one slow KV round trip (a NATS node failing over) must not push
        # the last partition's renewal past the TTL.
        ok = await asyncio.gather(*(leases.renew(f"part.{p}") for p in held), leases.renew(me) if me in leases.revision else leases.take(me))
        if me not in leases.revision:
            await leases.take(me)
        for p, renewed in zip(held, ok[:-1], strict=True):
            key = f"part.{p}"
            if key not in leases.revision:  # a definite answer: another replica holds it
                log.warning("detect %s: lost the lease of partition %d", self.id, p)
                self.partitions_lost += 1
                await self.drop(p)
            elif not renewed:  # NATS does not answer: keep the partition's state, publish nothing under it
                log.info("detect %s: lease of partition %d not confirmed (NATS does not answer); holding its state", self.id, p)
            elif p in self.parts:
                self.parts[p].epoch = leases.epoch.get(key, self.parts[p].epoch)  # taken again after it expired: a new epoch

    async def rebalance(self, leases: Leases) -> None:
        """Grow or shrink to the fair share of the live members."""
        live = await leases.keys()
        if live is None:
            return  # the lease table cannot be read now: no move on a guess
        members = max(1, sum(1 for k in live if k.startswith("member.")))
        share = math.ceil(self.fleet.partitions / members)
        if len(self.parts) > share:  # a replica joined: hand back the surplus
            for p in sorted(self.parts)[share:]:
                await self.handover(p)
                await self.drop(p)
                await leases.release(f"part.{p}")
        start = abs(hash(self.id)) % self.fleet.partitions
        # Only partitions nobody holds (one keys() call, not a failed create per held partition).
        free = [p for p in ((start + i) % self.fleet.partitions for i in range(self.fleet.partitions)) if p not in self.parts and f"part.{p}" not in live]
        want = share - len(self.parts)
        if want > 0 and free:
            taken = await asyncio.gather(*(leases.take(f"part.{p}") for p in free))
            for p, got in zip(free, taken, strict=True):
                if not got:
                    continue
                if want <= 0:  # took more than the share in one round: hand the rest back
                    await leases.release(f"part.{p}")
                    continue
                want -= 1
                log.info("detect %s: took partition %d (stream %s); replaying %gs", self.id, p, self.subjects.rows_stream_of(p), self.fleet.replay_seconds)
                self.partitions_taken += 1
                await self.adopt(p)

    async def adopt(self, p: int) -> None:
        pipeline, feed = self._pipeline()
        part = Partition(p, pipeline, feed)
        part.epoch = self.leases.epoch.get(f"part.{p}") if self.leases is not None else None
        self.parts[p] = part
        part.task = asyncio.create_task(self._consume(part))

    async def drop(self, p: int) -> None:
        part = self.parts.pop(p, None)
        if part is not None and part.task is not None:
            part.task.cancel()

    # -- carried-over state -----------------------------------------------------------------------
    async def restore(self, part: Partition) -> None:
        """Take the partition's state snapshot, unless it is stale: written under our own lease or
        a later one, older than the replay (rows between it and the replay's start nobody would
        see), or from an owner older than the last one that published the partition's findings."""
        if self.state_kv is None:
            return
        key = f"part.{part.p}"
        try:
            entry, last = await asyncio.wait_for(asyncio.gather(self._state_entry(key), self._last_findings(part.p)), self.fleet.lease_ttl_seconds / 2)
        except Exception as exc:  # noqa: BLE001 - NATS does not answer: the replay alone, as before
            log.info("detect %s: partition %d: state snapshot not read (%s); rebuilding from the replay alone", self.id, part.p, exc)
            return
        if entry is None:
            return
        part.state_rev = int(entry.revision or 0)
        try:
            doc, state = transport.decode_state(entry.value or b"")
            epoch, wall = doc.get("epoch"), float(doc.get("wall"))
        except Exception as exc:  # noqa: BLE001 - written by another version, or damaged
            self._ignore(part, "undecodable", f"undecodable ({exc})")
            return
        owner = doc.get("owner")
        if isinstance(epoch, int) and part.epoch is not None and epoch >= part.epoch:
            self._ignore(part, "epoch", f"written by {owner} under lease epoch {epoch}, not before ours ({part.epoch})")
            return
        if last is not None and not last.get("claim") and isinstance(last.get("epoch"), int) and isinstance(epoch, int) and last["epoch"] > epoch:
            self._ignore(part, "epoch", f"written by {owner} under lease epoch {epoch}, but {last.get('owner')} published the partition's findings under epoch {last['epoch']} since")
            return
        age = time.time() - wall
        if age > self.fleet.replay_seconds:
            self._ignore(part, "age", f"written by {owner} {age:.0f}s ago, before the {self.fleet.replay_seconds:g}s the replay reads (the rows between are not seen)")
            return
        try:
            n = part.pipeline.restore(state)
        except Exception as exc:  # noqa: BLE001 - a snapshot that decodes but does not fit this version
            self._ignore(part, "undecodable", f"not restorable ({exc})")
            part.pipeline, part.feed = self._pipeline()
            return
        self.state_restored += 1
        log.info("detect %s: restored partition %d from the state snapshot of %s (lease epoch %s, %.1fs old, data time %s): %d findings, detector state of %s",
                 self.id, part.p, owner, epoch, age, state.get("now"), n, ", ".join(sorted(state.get("detectors", {}))) or "none")

    def _ignore(self, part: Partition, reason: str, why: str) -> None:
        self.state_ignored[reason] = self.state_ignored.get(reason, 0) + 1
        log.warning("detect %s: partition %d: state snapshot ignored: %s; rebuilding from the replay alone", self.id, part.p, why)

    async def _state_entry(self, key: str) -> Any:
        from nats.js.errors import KeyDeletedError, KeyNotFoundError

        try:
            return await self.state_kv.get(key)
        except (KeyNotFoundError, KeyDeletedError):  # none yet, deleted, or expired with the rows it described
            return None

    async def _last_findings(self, p: int) -> dict[str, Any] | None:
        from nats.js.errors import NotFoundError

        try:
            msg = await self.js.get_last_msg(self.subjects.findings_stream, self.subjects.findings_part(p))
        except NotFoundError:
            return None
        try:
            doc = json.loads(msg.data)
        except ValueError:
            return None
        return doc if isinstance(doc, dict) else None

    def _snapshot(self, part: Partition) -> tuple[int | None, bytes]:
        """The partition's state as one KV value (under `tick_lock`: the pipeline is not ticking)."""
        state = part.pipeline.carry_over()
        stamps = {"owner": self.id, "epoch": part.epoch, "partition": part.p, "wall": time.time(), "last_seq": part.last_seq}
        body = transport.encode_state(stamps, state)
        if len(body) > self.fleet.state_max_bytes:
            # The findings are small (about 1 kB each); the detectors' state of a job of many
            # thousand ranks may not be: the next owner then times that job from its replay.
            self.state_trimmed += 1
            log.warning("detect %s: partition %d: state snapshot of %d bytes exceeds fleet.state_max_bytes %d; written without the detectors' state (%s)",
                        self.id, part.p, len(body), self.fleet.state_max_bytes, ", ".join(sorted(state["detectors"])))
            body = transport.encode_state(stamps, {**state, "detectors": {}})
        return part.epoch, body

    def _snapshot_locked(self, part: Partition) -> tuple[int | None, bytes]:
        with self.tick_lock:
            return self._snapshot(part)

    async def handover(self, p: int) -> None:
        """A clean handover: the partition's state as of now, for its next owner."""
        part = self.parts.get(p)
        if part is None or not part.caught_up or not part.pipeline.ticks or self.state_kv is None:
            return
        epoch, body = await asyncio.to_thread(self._snapshot_locked, part)
        await self._save(part, epoch, body)

    async def _save_pending(self) -> None:
        for part in list(self.parts.values()):
            pending, part.state_body = part.state_body, None
            if pending is not None:
                await self._save(part, *pending)

    async def _save(self, part: Partition, epoch: int | None, body: bytes) -> bool:
        """Write a snapshot under the lease it was taken under: only while that lease is valid, and
        only over what we read or wrote last (a compare-and-set on the key's revision). A write
        found in between is overwritten only when it comes from an earlier lease (an owner paused
        past its own, waking); a later lease's means the partition is no longer ours."""
        from nats.js.errors import KeyDeletedError, KeyNotFoundError, KeyWrongLastSequenceError

        key = f"part.{part.p}"
        for _ in range(3):
            if self.leases is None or part.epoch != epoch or not self.leases.valid(key):
                self.state_fenced += 1
                log.info("detect %s: partition %d: lease no longer valid, state snapshot not written", self.id, part.p)
                return False
            try:
                part.state_rev = await asyncio.wait_for(self.state_kv.update(key, body, last=part.state_rev), self.leases.call_timeout)
                self.state_written += 1
                return True
            except KeyWrongLastSequenceError:
                try:
                    entry = await asyncio.wait_for(self.state_kv.get(key), self.leases.call_timeout)
                except (KeyNotFoundError, KeyDeletedError) as exc:  # deleted or expired: a tombstone's revision, or none
                    entry = getattr(exc, "entry", None)
                try:
                    theirs = transport.decode_state(entry.value or b"")[0] if entry is not None and entry.value else {}
                except Exception:  # noqa: BLE001 - damaged: overwritten
                    theirs = {}
                if isinstance(theirs.get("epoch"), int) and epoch is not None and theirs["epoch"] > epoch:
                    self.state_fenced += 1
                    log.warning("detect %s: partition %d: %s wrote its state under lease epoch %d (ours %d): not overwritten",
                                self.id, part.p, theirs.get("owner"), theirs["epoch"], epoch)
                    return False
                part.state_rev = int(entry.revision or 0) if entry is not None else 0
            except Exception as exc:  # noqa: BLE001 - written again at the next interval
                log.info("detect %s: partition %d: state snapshot not written: %s", self.id, part.p, exc)
                return False
        return False

    # -- rows ------------------------------------------------------------------------------------
    async def _subscribe(self, part: Partition, replay: bool) -> Any:
        from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

        durable = f"{self.subjects.prefix}-detect-p{part.p}"
        if replay:
            try:
                await self.js.delete_consumer(self.subjects.rows_stream_of(part.p), durable)
            except Exception:  # noqa: BLE001 - none yet
                pass
            start = datetime.fromtimestamp(time.time() - self.fleet.replay_seconds, tz=UTC)
            cfg = ConsumerConfig(durable_name=durable, deliver_policy=DeliverPolicy.BY_START_TIME, opt_start_time=start.isoformat(),
                                 ack_policy=AckPolicy.NONE, max_waiting=64)
        else:  # after an error: on from the last sequence seen, nothing lost, nothing twice
            try:
                await self.js.delete_consumer(self.subjects.rows_stream_of(part.p), durable)
            except Exception:  # noqa: BLE001
                pass
            cfg = ConsumerConfig(durable_name=durable, deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=part.last_seq + 1,
                                 ack_policy=AckPolicy.NONE, max_waiting=64)
        return await self.js.pull_subscribe(self.subjects.part(part.p), durable=durable, stream=self.subjects.rows_stream_of(part.p), config=cfg)

    async def _consume(self, part: Partition) -> None:
        try:
            await self.restore(part)
        finally:
            part.restoring = False
        replay = True
        errors = idle = 0
        while True:
            try:
                if part.target_seq is None:
                    # Where the stream stands at takeover: the replay is complete only once the
                    # server says nothing of this partition up to there (and since) is unread.
                    part.target_seq = int((await self.js.stream_info(self.subjects.rows_stream_of(part.p))).state.last_seq or 0)
                if part.sub is None:
                    # Nothing consumed yet: the replay is still owed (a resubscription from
                    # sequence 1 would read the whole stream instead of replay_seconds of it).
                    part.sub = await self._subscribe(part, replay or part.last_seq == 0)
                    replay = False
                try:
                    msgs = await part.sub.fetch(512, timeout=1.0)
                except TimeoutError:
                    idle += 1
                    # A fetch that times out proves nothing (a server failing over answers late):
                    # only the consumer's own count of unread messages does. Asked on every idle
                    # fetch while replaying, every third one after (raises if the consumer is gone).
                    if not part.caught_up or idle % 3 == 0:
                        info = await part.sub.consumer_info()
                        part.pending = int(info.num_pending or 0)
                        if not part.caught_up and part.pending == 0:
                            self._mark_caught_up(part)
                    continue
                errors = idle = 0
                # Decoding (Arrow IPC) off the event loop, so lease renewals never wait on a replay.
                decoded = await asyncio.to_thread(lambda batch=msgs: [self._decode(part, m) for m in batch])
                for m, item in zip(msgs, decoded, strict=True):
                    self._ingest(part, m, item)
                if msgs:
                    part.pending = msgs[-1].metadata.num_pending
                if msgs and msgs[-1].metadata.num_pending == 0 and not part.caught_up:
                    self._mark_caught_up(part)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - a NATS node died / consumer lost: resubscribe
                errors += 1
                log.info("detect %s: partition %d consumer error (%s); resubscribing from seq %d", self.id, part.p, exc, part.last_seq + 1)
                if part.sub is not None:
                    try:
                        await part.sub.unsubscribe()
                    except Exception:  # noqa: BLE001
                        pass
                part.sub = None
                await asyncio.sleep(min(2.0, 0.2 * errors))

    def _mark_caught_up(self, part: Partition) -> None:
        part.caught_up = True
        part.caught_up_wall = time.monotonic()
        log.info("detect %s: partition %d rebuilt from the stream (%d messages to seq %d, the stream at seq %s when taken; %.2fs)",
                 self.id, part.p, part.messages, part.last_seq, part.target_seq, part.caught_up_wall - part.taken_wall)

    def _decode(self, part: Partition, m: Any) -> tuple[dict[str, pl.DataFrame], float] | None:
        h = m.headers or {}
        try:
            return transport.decode_frames(m.data, h.get("Gv-Frames", "")), float(h.get("Gv-Now", "nan"))
        except Exception as exc:  # noqa: BLE001 - a bad message is counted, never fatal
            log.warning("detect %s: undecodable message on %s: %s", self.id, m.subject, exc)
            return None

    def _ingest(self, part: Partition, m: Any, decoded: tuple[dict[str, pl.DataFrame], float] | None) -> None:
        part.last_seq = m.metadata.sequence.stream
        part.messages += 1
        h = m.headers or {}
        if decoded is None:
            part.feed.errors += 1
            return
        frames, now = decoded
        if not math.isnan(now):
            if not self.clock.offer(now, f"{m.subject} (node {h.get('Gv-Node', '?')})", "rows"):
                part.feed.future += 1
                return  # from the future: its rows would sit ahead of every window
            part.newest_now = max(part.newest_now, now)
        stream = self.subjects.rows_stream_of(part.p)
        self.stream_messages[stream] = self.stream_messages.get(stream, 0) + 1
        self.stream_rows[stream] = self.stream_rows.get(stream, 0) + sum(df.height for s, df in frames.items() if s in transport.ROW_STREAMS)
        part.feed.add(frames, h.get("Gv-Node", ""), h.get("Gv-Job", ""), now)

    # -- ticks -----------------------------------------------------------------------------------
    def tick(self, now: float) -> list[tuple[int, int | None, str, bytes]]:
        """Each held partition's message: (partition, lease epoch, subject, body)."""
        with self.tick_lock:
            return self._tick(now)

    def _tick(self, now: float) -> list[tuple[int, int | None, str, bytes]]:
        c0 = time.thread_time()
        out = []
        for part in list(self.parts.values()):
            if part.restoring:
                continue
            if not part.caught_up:
                # Never judge a half-replayed window; claim the partition meanwhile, so readers
                # fence its previous owner off and keep its findings until ours are ready.
                if now - part.claimed_at >= self.fleet.findings_refresh_seconds:
                    part.claimed_at = now
                    out.append((part.p, part.epoch, self.subjects.findings_part(part.p),
                                transport.findings_payload("detect", now, [], partition=part.p, owner=self.id, epoch=part.epoch, claim=True)))
                continue
            self._asks = []
            result = part.pipeline.tick(now)
            self._queue_dump_requests(part, now)
            for f in result.new_findings:
                log.info("detect %s: p%d finding %s %s: %s", self.id, part.p, f.severity.value, f.kind.value, f.summary)
            active = sorted(part.pipeline.active.values(), key=lambda f: f.id)
            key = tuple(f.id for f in active)
            if key != part.published or now - part.published_at >= self.fleet.findings_refresh_seconds:
                part.published, part.published_at = key, now
                jobs = part.pipeline.window.get("jobs")
                # Tenants of the partition's jobs: act routes alerts by tenant (alerts.team_of_tenant).
                tenants = dict(zip(jobs["job"].to_list(), jobs["tenant"].to_list(), strict=True)) if jobs.height else {}
                # first_seen: when each finding was first reported (its age), kept across takeovers.
                first_seen = {f.id: part.pipeline.first_seen[f.id] for f in active}
                out.append((part.p, part.epoch, self.subjects.findings_part(part.p),
                            transport.findings_payload("detect", now, active, partition=part.p, owner=self.id, epoch=part.epoch, tenants=tenants,
                                                       first_seen=first_seen)))
            if self.state_kv is not None and now - part.state_at >= self.fleet.state_snapshot_seconds:
                part.state_at = now
                part.state_body = self._snapshot(part)
        self.ticks += 1
        self.tick_cpu_seconds += time.thread_time() - c0
        return out

    def _queue_dump_requests(self, part: Partition, now: float) -> None:
        from gpuvigil.app.compose import dump_trigger_of

        if not self._asks:
            return
        trigger = dump_trigger_of(part.pipeline)
        for job, node in self._asks:
            how = trigger.requests.how.get(job, "on_demand") if trigger is not None else "on_demand"
            body = json.dumps({"job": job, "how": how, "now": now, "partition": part.p, "owner": self.id}).encode()
            self.dump_requests.append((part.p, part.epoch, self.subjects.fr_request(node), body))
            log.info("detect %s: p%d asks node %s for Flight Recorder dumps of job %s (%s)", self.id, part.p, node, job, how)
        self._asks = []

    async def _publish_dump_requests(self, leases: Leases) -> None:
        """Core NATS, not stored: a request is worth something only now, and the trigger asks
        again while the suspicion lasts."""
        out, self.dump_requests = self.dump_requests, []
        for p, epoch, subject, body in out:
            part = self.parts.get(p)
            if part is None or part.epoch != epoch or not leases.valid(f"part.{p}"):
                continue
            try:
                await self.nc.publish(subject, body)
                self.dumps_asked += 1
            except Exception as exc:  # noqa: BLE001 - the trigger asks again while the suspicion lasts
                log.info("detect %s: dump request not sent: %s", self.id, exc)

    async def run(self) -> None:
        self.nc = nc = await connection.connect(self.fleet, f"gpuvigil-detect-{self.id}", role=NAME)
        self.js = nc.jetstream(timeout=5)
        try:
            await transport.ensure(self.js, self.fleet)
            await self.clock.subscribe(nc, self.subjects)
            kv = await self.js.key_value(self.subjects.leases_bucket)
            self.state_kv = await self.js.key_value(self.subjects.state_bucket)
            self.leases = leases = Leases(kv, self.id, self.fleet.lease_ttl_seconds)
            renew_every = self.fleet.lease_ttl_seconds / 4

            async def keep(step: Any, what: str) -> None:
                # Their own tasks: a slow tick or a findings publish during a NATS failover never
                # delays the renewals, nor does a slow read of the lease table (a consumer on the
                # bucket, created anew after a server loss) when growing or shrinking.
                while True:
                    try:
                        await step(leases)
                    except Exception as exc:  # noqa: BLE001 - retried next round; leases expire only after the TTL
                        log.info("detect %s: %s round failed: %s", self.id, what, exc)
                    await asyncio.sleep(renew_every)

            await self.renew(leases)  # the membership first, so the first share counts us
            lease_tasks = [asyncio.create_task(keep(self.renew, "lease renewal")), asyncio.create_task(keep(self.rebalance, "rebalance"))]
            deadline = time.monotonic() + self.args.duration if self.args.duration else None
            while not self.stop_event.is_set() and (deadline is None or time.monotonic() < deadline):
                now = self.clock.now
                if now - self.last_tick >= self.tick_seconds and math.isfinite(now):
                    self.last_tick = now
                    for p, epoch, subject, body in await asyncio.to_thread(self.tick, now):
                        part = self.parts.get(p)
                        if part is None or part.epoch != epoch or not leases.valid(f"part.{p}"):
                            # The lease ran out while this was computed (or this process was
                            # paused past it): another replica may own the partition now.
                            self.fenced += 1
                            log.warning("detect %s: partition %d: lease no longer valid, not publishing", self.id, p)
                            continue
                        try:
                            await self.js.publish(subject, body)
                            self.findings_published += 1
                        except Exception as exc:  # noqa: BLE001 - republished on the next refresh
                            log.info("detect %s: findings publish failed: %s", self.id, exc)
                    await self._publish_dump_requests(leases)
                    # Its own task: a slow KV write (a NATS node failing over) never delays a tick.
                    if any(part.state_body is not None for part in self.parts.values()) and (self.state_saving is None or self.state_saving.done()):
                        self.state_saving = asyncio.create_task(self._save_pending())
                try:
                    await asyncio.wait_for(self.stop_event.wait(), 0.1)
                except TimeoutError:
                    pass
            for t in lease_tasks:
                t.cancel()
            # Collected, so a clean stop logs no "exception was never retrieved" traceback.
            await asyncio.gather(*lease_tasks, return_exceptions=True)
            held = list(self.parts)
            if self.state_saving is not None:
                self.state_saving.cancel()
            # The state as of the last tick, for the next owners (bounded: SIGTERM exits within 5 s).
            try:
                await asyncio.wait_for(asyncio.gather(*(self.handover(p) for p in held), return_exceptions=True), 1.5)
            except TimeoutError:
                log.info("detect %s: state snapshots at stop cut short after 1.5s (the last periodic ones stand)", self.id)
            for p in held:
                await self.drop(p)
            # A clean stop hands the partitions over at once (bounded: SIGTERM exits within 5 s).
            await transport.shutdown(nc, *(leases.release(f"part.{p}") for p in held), leases.release(f"member.{self.id}"))
        finally:
            await transport.shutdown(nc)


def run(args: argparse.Namespace) -> int:
    from gpuvigil.util.logsetup import configure as configure_logging

    configure_logging(args.log_level)
    from gpuvigil.fleet.metrics import detect_families, endpoint

    d = Detect(args)

    async def main() -> None:
        install_signals(asyncio.get_running_loop(), d.stop_event)
        print(f"gpuvigil detect {d.id}: {d.fleet.partitions} partitions; NATS {', '.join(d.fleet.servers)}", flush=True)
        await d.run()

    with endpoint("detect", d.id, lambda: detect_families(d), args.metrics_host, args.metrics_port) as d.metrics_port:
        asyncio.run(main())
    print(f"gpuvigil detect {d.id}: stopped after {d.ticks} ticks", flush=True)
    return 0
