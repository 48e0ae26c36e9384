"""`gpuvigil act`: the one place that turns findings into alerts and hints, highly available
through a KV lease (`act.leader`). Standbys wait for the lease; the leader reads the findings
stream (the latest state of every agent and partition first, then every update) and runs a
`Pipeline` whose one detector (`Relay`) reports the findings those sources hold active. So the
lifecycle (new / active / cleared), the hint rules and cooldown, the alert pusher with its
durable outbox, the hint store and `--act` are the ones `serve` runs. The same Pipeline runs the
cluster-scope detector `fragmentation_cluster` over the agents' node summaries (`ClusterView`,
read from `gv.cluster.>`), so its findings take that path too. `--metrics-port` serves /metrics
(gpuvigil.fleet.metrics: leader and lease state, findings processed, pages, hints, lag).

A finding processed twice never pages or acts twice:
- alerts: the pusher re-sends firing alerts with the same labels, which Alertmanager merges into
  the alert it already notified (a new leader re-sends what the old one sent: no new page);
- hints: a hint is issued by the leader that claims it in the ledger bucket (`create` of
  `hint.<id>` succeeds once), after it recorded the hint in the fleet's one hint store (the same
  bucket, `rec.<id>`: gpuvigil.fleet.hints; `--hint-db` is the leader's working copy, loaded when
  its term starts). What acting did is recorded there too, so a new leader applies what an earlier
  one recorded but never applied, and repeats nothing it did. The ledger also records each
  finding's episode (`finding.<id>`: firing or resolved) for the record of who paged what;
- incidents: a pipeline names an incident after its first finding and the time it first saw it,
  so two replicas would name one fault differently, and a new name is a new alert (a second
  page). The leader records each active finding's incident in the ledger (`incident.<id>`: the
  incident's id, the finding's role in it, the incident's opening time and team) before any sink
  sends an alert, and a new leader adopts those records when its term starts: the findings it
  reads again join the same incidents with the same roles and teams, and their alerts carry the
  labels the old leader sent.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import socket
import time
from pathlib import Path
from typing import Any

from gpuvigil.errors import UserError
from gpuvigil.fleet import connection, transport
from gpuvigil.fleet.agent import add_common, add_metrics_args, install_signals, load
from gpuvigil.fleet.lease import LEADER_KEY, Leases
from gpuvigil.fleet.metrics import ActStats
from gpuvigil.fleet.clock import from_fleet as clock_of
from gpuvigil.fleet.fence import Fence
from gpuvigil.fleet.transport import Subjects
from gpuvigil.model import Finding

log = logging.getLogger("gpuvigil.fleet")
NAME = "act"
INCIDENT_PREFIX = "incident."


def add_parser(sub) -> None:
    p = sub.add_parser(NAME, help="findings → alerts and hints, one leader through a NATS KV lease")
    add_common(p, NAME)
    p.add_argument("--id", help="replica id (default: hostname-pid)")
    p.add_argument("--alertmanager", action="append", default=[], help="Alertmanager base URL; repeat for every peer of a cluster (default: alerts.alertmanagers)")
    p.add_argument("--outbox", default="gpuvigil-act-outbox.sqlite", help="SQLite alert outbox of this replica")
    p.add_argument("--hint-db", help="this replica's working copy (SQLite) of the fleet's hint store, loaded from NATS when it becomes leader")
    p.add_argument("--api-port", type=int, help="while leader, also serve the scheduler feedback API over --hint-db on this port (0: a free one)")
    p.add_argument("--api-host", default="127.0.0.1", help="address of the feedback API (default 127.0.0.1)")
    p.add_argument("--api-token-file", type=Path, help="bearer token file of the feedback API (else $GPUVIGIL_API_TOKEN)")
    p.add_argument("--insecure-local", action="store_true", help="feedback API without a token, on 127.0.0.1 only")
    p.add_argument("--scheduler", choices=["slurm", "kubernetes", "none"], help="the scheduler the leader acts on (sources.scheduler, as serve)")
    p.add_argument("--act", choices=["off", "dry-run", "on"], help="what the leader does with hints on the scheduler (sources.act, as serve; default dry-run)")
    add_metrics_args(p)
    p.set_defaults(func=run)


class Relay:
    """The act Pipeline's one detector: the findings the fleet's sources hold active now."""

    name = "fleet_relay"
    level = "L0"
    capability = None
    streams = ()

    def __init__(self, stale_seconds: float):
        self.stale_seconds = stale_seconds
        self.sources: dict[str, tuple[float, float, list[Finding]]] = {}  # subject → (data now, wall, findings)
        self.tenants: dict[str, str] = {}
        self._tenants_sent: dict[str, str] = {}

    def hold(self, subject: str) -> None:
        """A new owner claimed the source and catches up: keep its last findings meanwhile (the
        stale clock restarts), so a takeover neither clears nor re-pages them."""
        old = self.sources.get(subject)
        if old is not None:
            self.sources[subject] = (old[0], time.monotonic(), old[2])

    def update(self, subject: str, now: float, findings: list[Finding], tenants: dict[str, str] | None = None) -> None:
        old = self.sources.get(subject)
        if old is None or now >= old[0]:
            self.sources[subject] = (now, time.monotonic(), findings)
        if tenants:
            self.tenants.update({j: t for j, t in tenants.items() if j and t is not None})

    def detect(self, window: Any) -> list[Finding]:
        cutoff = time.monotonic() - self.stale_seconds
        out: dict[str, Finding] = {}
        for _now, wall, findings in self.sources.values():
            if wall < cutoff:
                continue  # its owner is gone and nobody took over yet: let the finding age out
            for f in findings:
                if f.id not in out or f.ts > out[f.id].ts:
                    out[f.id] = f.model_copy(deep=True)
        return list(out.values())


class ClusterView:
    """The cluster as the agents' node summaries (`gv.cluster.node.<node>`) describe it: the
    `nodes`, `allocations` and pending `jobs` that `fragmentation_cluster` reads in `serve`.
    A node silent for `stale_seconds` (its agent died) leaves the view; the queue is the newest
    one any agent reported (every Slurm-reading agent sees the same queue)."""

    def __init__(self, stale_seconds: float):
        self.stale_seconds = stale_seconds
        self.nodes: dict[str, tuple[float, dict[str, Any]]] = {}  # node → (wall, summary)
        self.queue: tuple[float, list[dict[str, Any]]] = (float("-inf"), [])  # (data now, pending jobs)
        self.version = 0
        self.messages = 0

    def update(self, doc: dict[str, Any], now: float) -> bool:
        """Take a node's summary; False (and nothing taken) when it is malformed."""
        node, row, allocs, pending = doc.get("node"), doc.get("row"), doc.get("allocations", []), doc.get("pending", [])
        if not (isinstance(node, str) and (row is None or isinstance(row, dict)) and isinstance(allocs, list) and isinstance(pending, list)
                and all(isinstance(a, list) and len(a) == 3 for a in allocs) and all(isinstance(j, dict) and isinstance(j.get("job"), str) for j in pending)):
            return False
        self.messages += 1
        old = self.nodes.get(node)
        if old is None or old[1] != doc:
            self.version += 1
        self.nodes[node] = (time.monotonic(), doc)
        if "pending" in doc and now >= self.queue[0]:
            if doc["pending"] != self.queue[1]:
                self.version += 1
            self.queue = (now, list(doc["pending"]))
        return True

    def expire(self) -> None:
        cutoff = time.monotonic() - self.stale_seconds
        gone = [n for n, (wall, _) in self.nodes.items() if wall < cutoff]
        for n in gone:
            del self.nodes[n]
        if gone:
            self.version += 1

    def frames(self) -> dict[str, Any]:
        from gpuvigil import schemas

        rows = [doc["row"] for _, doc in self.nodes.values() if doc.get("row")]
        alloc = [{"job": j, "rank": r, "node": doc["node"], "gpu": g} for _, doc in self.nodes.values() for j, r, g in doc.get("allocations", [])]
        return {"nodes": schemas.frame(rows, schemas.NODES), "allocations": schemas.frame(alloc, schemas.ALLOCATIONS), "pending": self.queue[1]}


class TenantFeed:
    """The act Pipeline's collector: a `jobs` snapshot (job, tenant) from what detect reported,
    so alerts carry the tenant and route to its team as `serve`'s do; and, from the agents' node
    summaries (`ClusterView`), the `nodes`, `allocations` and pending jobs that the
    cluster-scope detectors read."""

    name = "fleet_tenants"

    def __init__(self, relay: Relay, cluster: ClusterView | None = None):
        from gpuvigil import schemas

        self.relay = relay
        self.cluster = cluster
        self.streams = {"jobs": schemas.JOBS, "nodes": schemas.NODES, "allocations": schemas.ALLOCATIONS}
        self.errors = 0
        self._version = -1

    def collect(self, now: float) -> dict[str, Any]:
        from gpuvigil import schemas

        if self.cluster is not None:
            self.cluster.expire()
        version = self.cluster.version if self.cluster is not None else 0
        if self.relay.tenants == self.relay._tenants_sent and version == self._version:
            return {}
        self.relay._tenants_sent = dict(self.relay.tenants)
        self._version = version
        out: dict[str, Any] = {}
        pending: list[dict[str, Any]] = []
        if self.cluster is not None:
            view = self.cluster.frames()
            pending = view.pop("pending")
            out.update(view)
        queued = {r["job"] for r in pending}
        rows = [*pending, *({"job": j, "tenant": t} for j, t in self.relay.tenants.items() if j not in queued)]
        out["jobs"] = schemas.frame(rows, schemas.JOBS)
        return out


class Ledger:
    """Claims in the ledger bucket: each hint is issued by exactly one leader, once; and where
    each active finding was placed (its incident), for the next leader to adopt."""

    def __init__(self, kv: Any, owner: str):
        self.kv = kv
        self.owner = owner
        self.claimed = 0
        self.skipped = 0
        self.incidents: dict[str, dict[str, Any]] = {}  # finding id → its `incident.<id>` record, as the bucket holds it

    async def load_incidents(self) -> dict[str, dict[str, Any]]:
        """Every finding's incident record in the bucket (the start of a term). Records that do
        not read as one are skipped: an unreadable record names no incident."""
        from gpuvigil.fleet.hints import entries

        out: dict[str, dict[str, Any]] = {}
        for k, value in await entries(self.kv, INCIDENT_PREFIX):
            try:
                doc = json.loads(value)
            except ValueError:
                doc = None
            rec = _incident_record(doc)
            if rec is None:
                log.warning("ledger: unreadable incident record %s: skipped", k)
                continue
            out[k.removeprefix(INCIDENT_PREFIX)] = rec
        self.incidents = out
        return out

    async def name_incidents(self, result: Any, opened_at: dict[str, float], teams: dict[str, str], awaiting: set[str]) -> None:
        """Record the incident (id, role, opening time, team) of every active finding whose record
        is missing or says otherwise; delete the records of findings neither active nor still
        `awaiting` (adopted, not reported yet). Runs before any alert is sent, so the next leader
        finds every incident an alert named."""
        active: set[str] = set()
        changed: dict[str, dict[str, Any]] = {}
        for f in result.active_findings:
            if not f.incident:
                continue
            active.add(f.id)
            known = self.incidents.get(f.id) or {}
            # starts_at: the wall time its first alert started (Alertmanager's startsAt); every
            # leader sends the alert with it, so a takeover does not restart the alert's clock.
            doc = {"incident": f.incident, "role": f.incident_role, "opened_at": opened_at.get(f.incident, f.ts), "team": teams.get(f.incident),
                   "starts_at": known.get("starts_at") or time.time()}
            if known != doc:
                changed[f.id] = doc
        gone = [fid for fid in self.incidents if fid not in active and fid not in awaiting]
        # Together, not one round trip after another: a fault seen by many findings at once
        # (a switch, a storm) must not hold its pages back.
        done = await asyncio.gather(*(self.record(f"{INCIDENT_PREFIX}{fid}", doc) for fid, doc in changed.items()),
                                    *(self.kv.delete(f"{INCIDENT_PREFIX}{fid}") for fid in gone), return_exceptions=True)
        for (fid, doc), r in zip(changed.items(), done, strict=False):
            if not isinstance(r, BaseException):
                self.incidents[fid] = doc
        for fid, r in zip(gone, done[len(changed):], strict=True):
            if not isinstance(r, BaseException):
                del self.incidents[fid]
        failed = [r for r in done if isinstance(r, BaseException)]
        if failed:
            raise failed[0]

    async def claim(self, key: str, doc: dict[str, Any]) -> bool:
        from nats.js.errors import KeyWrongLastSequenceError

        try:
            await self.kv.create(key, json.dumps({**doc, "by": self.owner}).encode())
        except KeyWrongLastSequenceError:
            return False
        return True

    async def record(self, key: str, doc: dict[str, Any]) -> None:
        await self.kv.put(key, json.dumps({**doc, "by": self.owner}).encode())

    async def gate(self, result: Any) -> None:
        """Keep only the hints this leader is the first to claim; record finding episodes."""
        kept = []
        for h in result.new_hints:
            if await self.claim(f"hint.{h.id}", {"finding": h.finding_id, "action": h.action.value, "ts": h.ts}):
                kept.append(h)
                self.claimed += 1
            else:
                self.skipped += 1
        result.new_hints = kept
        for f in result.new_findings:
            await self.record(f"finding.{f.id}", {"state": "firing", "kind": f.kind.value, "ts": f.ts})
        for f in result.cleared_findings:
            await self.record(f"finding.{f.id}", {"state": "resolved", "kind": f.kind.value, "ts": f.ts})
            # A cause that comes back later is a new episode: its hints may be issued again
            # (the pipeline's own hint cooldown still applies).
            for h in result.expired_hints:
                if h.finding_id == f.id:
                    try:
                        await self.kv.delete(f"hint.{h.id}")
                    except Exception:  # noqa: BLE001
                        pass


# Imported lazily by a leader (a standby never needs them; `gpuvigil act --help` stays fast).
_LEADER_MODULES = ("gpuvigil.alerts.pusher", "gpuvigil.api", "gpuvigil.api.app", "gpuvigil.api.auth", "gpuvigil.app.acting",
                   "gpuvigil.fleet.hints", "gpuvigil.scheduler.slurm", "gpuvigil.scheduler.kubernetes", "gpuvigil.scheduler.remediation",
                   "gpuvigil.scheduler.apply", "gpuvigil.exporter.metrics")


def _import_leader_modules() -> None:
    import importlib

    for name in _LEADER_MODULES:
        importlib.import_module(name)


def _incident_record(doc: Any) -> dict[str, Any] | None:
    """An `incident.<id>` record as `Ledger.name_incidents` writes it (its writer left out), or
    None when `doc` is not one."""
    from gpuvigil.pipeline.incidents import EVIDENCE, OPENED, UPDATE

    if not isinstance(doc, dict):
        return None
    inc, role, opened, team, starts = doc.get("incident"), doc.get("role"), doc.get("opened_at"), doc.get("team"), doc.get("starts_at")
    if not (isinstance(inc, str) and inc and role in (OPENED, UPDATE, EVIDENCE) and _finite(opened) and (team is None or isinstance(team, str))):
        return None
    # A record without a readable start (an older writer's) gets one from the leader that reads it.
    return {"incident": inc, "role": role, "opened_at": opened, "team": team, "starts_at": starts if _finite(starts) else None}


def _finite(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


class Act:
    def __init__(self, args: argparse.Namespace):
        from gpuvigil import config
        from gpuvigil.alerts.settings import load_settings

        self.args = args
        self.cfg, self.fleet = load(args)
        for url in args.alertmanager:
            if not url.startswith(("http://", "https://")):
                raise UserError(f"--alertmanager {url!r}: expected an http(s):// URL")
        if args.api_port is not None:
            if not args.hint_db:
                raise UserError("--api-port serves the hint store: give --hint-db too")
            if args.api_token_file is None and not args.insecure_local and "GPUVIGIL_API_TOKEN" not in os.environ:
                raise UserError("--api-port needs a token: --api-token-file FILE or $GPUVIGIL_API_TOKEN (or --insecure-local for a token-less API on 127.0.0.1)")
        try:
            self.alert_settings = load_settings(self.cfg)
        except config.ConfigError as exc:
            raise UserError(str(exc)) from exc
        # `sources.scheduler` / `sources.act` (or --scheduler / --act), read as `serve` reads them.
        from gpuvigil.config import deploy as deployconfig

        flags = argparse.Namespace(scheduler=getattr(args, "scheduler", None), act=getattr(args, "act", None))
        self.sources_cfg = deployconfig.from_config(self.cfg, flags, where=args.config or "config")
        if self.sources_cfg.scheduler == "kubernetes" and self.sources_cfg.act == "on":
            # Fail at start, not when this standby becomes leader: credentials are read now
            # (no API call); the leader builds its own on taking the lease.
            from gpuvigil.app.acting import make_acting

            make_acting("kubernetes", "on", store=None, cfg=self.cfg)
        self.acting = None
        self.id = args.id or f"{socket.gethostname()}-{os.getpid()}"
        self.subjects = Subjects(self.fleet)
        self.clock = clock_of(self.fleet)
        self.stop_event = asyncio.Event()
        self.relay = Relay(self.fleet.findings_stale_seconds)
        self.fence = Fence()
        self.cluster = ClusterView(self.fleet.findings_stale_seconds)
        # The relay, then the detectors placed in act (those that need the whole cluster, such
        # as fragmentation_cluster), over the agents' node summaries. Its outputs are the
        # leader's (`_open_outputs`), applied after each tick.
        from gpuvigil.app import compose

        self.pipeline = compose.build(self.cfg, NAME, [TenantFeed(self.relay, self.cluster)], fleet=self.fleet, lead=[self.relay])
        self.stats = ActStats()
        self.leases: Leases | None = None
        self.ledger: Ledger | None = None
        self.metrics_port: int | None = None
        self.sinks: list[Any] = []
        self.store: Any = None  # the leader's --hint-db: its working copy of the fleet's hint store
        self.shared: Any = None  # gpuvigil.fleet.hints.SharedHints over the ledger bucket, while leader
        self.closers: list[Any] = []
        self.pusher = None
        self.api = None
        self.leader_since: float | None = None
        self.ticks = 0
        self.last_tick = float("-inf")

    def _open_outputs(self) -> None:
        """Outputs open only once leader: a standby holds no outbox writer and pushes nothing."""
        peers = self.args.alertmanager or self.alert_settings.alertmanagers
        store = None
        if peers:
            from gpuvigil.alerts.pusher import AlertPusher, DeliveryLoop

            # Every Alertmanager peer gets every alert (they dedupe among themselves by gossip).
            self.pusher = AlertPusher(list(peers), self.args.outbox, self.alert_settings)
            self.sinks.append(self.pusher)
            delivery = DeliveryLoop(self.pusher, interval=0.2).start()
            self.closers += [self.pusher.close, delivery.stop]
        if self.args.hint_db:
            from gpuvigil.api import HintStore

            store = HintStore(self.args.hint_db)
            self.store = store
            self.sinks.append(store)
            self.closers.append(store.close)
            if self.args.api_port is not None:
                # The same feedback API `serve --api-port` and `gpuvigil api` serve, over this
                # leader's store; it moves with the lease (a standby serves nothing).
                from gpuvigil.api.app import create_app, serve_api_in_thread
                from gpuvigil.api.auth import resolve_token

                token = resolve_token(self.args.api_token_file)
                app = create_app(store, token, insecure_local=self.args.insecure_local and token is None, cfg=self.cfg)
                self.api = serve_api_in_thread(app, self.args.api_host, self.args.api_port)
                self.closers.append(self.api.stop)
                print(f"gpuvigil act {self.id}: feedback API {self.api.url}", flush=True)
        self._open_acting(store)

    def _open_acting(self, store: Any) -> None:
        """The leader's `Acting`, built by the one function `serve` uses: it applies (act: on) or
        describes (act: dry-run) the hints this leader claimed, through the Slurm or Kubernetes
        adapter; with --hint-db it works from the store's pending hints (ack/nack/retry there),
        without it from each tick's new hints."""
        from gpuvigil.app.acting import make_acting

        src = self.sources_cfg
        self.acting = make_acting(src.scheduler, src.act, store=store, cfg=self.cfg, pager=self.pusher.page if self.pusher is not None else None)
        if self.acting is not None:
            print(f"gpuvigil act {self.id}: act {self.acting.mode} on {self.acting.scheduler}", flush=True)

    def close(self) -> None:
        for c in reversed(self.closers):
            try:
                c()
            except Exception:  # noqa: BLE001
                log.exception("act: close failed")
        self.closers = []

    def _on_findings(self, m: Any) -> None:
        try:
            doc, found = transport.parse_findings(m.data)
        except Exception as exc:  # noqa: BLE001 - a bad message never stops act
            log.warning("act: undecodable findings on %s: %s", m.subject, exc)
            self.stats.bad_messages += 1
            return
        now = doc.get("now")
        if not self.clock.offer(now, m.subject, "findings"):
            # From the future (or no time at all): taken, it would hold this source's findings
            # over every later, true message; ignored, the source's next message counts.
            self.stats.future_messages += 1
            return
        now = float(now)
        if not self.fence.admit(m.subject, doc):
            return  # from a replica that lost the partition's lease (paused past it)
        if doc.get("claim"):
            self.relay.hold(m.subject)
        else:
            self.relay.update(m.subject, now, found, doc.get("tenants"))
        self.stats.findings_messages += 1
        self.stats.newest_findings_now = max(self.stats.newest_findings_now, now)

    def _on_cluster(self, m: Any) -> None:
        try:
            doc = json.loads(m.data)
            now = float((m.headers or {}).get("Gv-Now", "nan"))
        except (ValueError, TypeError) as exc:
            log.warning("act: undecodable node summary on %s: %s", m.subject, exc)
            self.stats.bad_messages += 1
            return
        if not (isinstance(doc, dict) and self.cluster.update(doc, now if math.isfinite(now) else float("-inf"))):
            log.warning("act: malformed node summary on %s", m.subject)
            self.stats.bad_messages += 1

    async def _read(self, stream: str, subject: str, handle: Any, kind: str) -> None:
        """Read a stream: the latest message of every subject, then every new one."""
        from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

        errors = idle = 0
        last_seq = 0
        sub = None
        while True:
            try:
                if sub is None:
                    if last_seq:
                        cfg = ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=last_seq + 1, ack_policy=AckPolicy.NONE, inactive_threshold=30)
                    else:
                        cfg = ConsumerConfig(deliver_policy=DeliverPolicy.LAST_PER_SUBJECT, ack_policy=AckPolicy.NONE, inactive_threshold=30)
                    sub = await self.js.pull_subscribe(subject, stream=stream, config=cfg)
                try:
                    msgs = await sub.fetch(256, timeout=1.0)
                except TimeoutError:
                    self.stats.pending[kind] = 0
                    idle += 1
                    if idle % 3 == 0:  # quiet, or its server died with it: ask (raises if it is gone)
                        await sub.consumer_info()
                    continue
                errors = idle = 0
                for m in msgs:
                    last_seq = m.metadata.sequence.stream
                    handle(m)
                if msgs:
                    self.stats.pending[kind] = msgs[-1].metadata.num_pending
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - a NATS node died: resubscribe where we were
                errors += 1
                log.info("act %s: %s consumer error (%s); resubscribing", self.id, kind, exc)
                sub = None
                await asyncio.sleep(min(2.0, 0.2 * errors))

    async def _tick(self, now: float, ledger: Ledger) -> None:
        result = await asyncio.to_thread(self.pipeline.tick, now)
        recorded = True
        if self.shared is not None:
            # Recorded first, in the fleet's hint store (gpuvigil.fleet.hints), then claimed and
            # applied: a leader that dies in between leaves them to the next one, never lost.
            self.store.on_tick(result, self.pipeline.window)
            recorded = await self._push_hints()
        await ledger.gate(result)
        # Before any alert names an incident: the next leader must find the name to send it again.
        live = self.pipeline.incidents.live
        teams = self.pusher.incident_teams(result, self.pipeline.window) if self.pusher is not None else {}
        await ledger.name_incidents(result, {i: inc.opened_at for i, inc in live.items()}, teams, set(self.pipeline.incidents.adopted))
        if self.pusher is not None:
            self.pusher.adopt_starts({fid: rec["starts_at"] for fid, rec in ledger.incidents.items() if rec.get("starts_at")})
        for f in result.new_findings:
            log.info("act %s: finding %s %s: %s", self.id, f.severity.value, f.kind.value, f.summary)
        self.stats.on_tick(self, result, now)
        for sink in self.sinks:
            if sink is not self.store or self.shared is None:
                sink.on_tick(result, self.pipeline.window)
        if self.acting is not None and recorded:
            # After the store (which records the claimed hints first); scontrol / API calls run
            # off the event loop so the lease keeps being renewed.
            await asyncio.to_thread(self.acting.on_tick, result, self.pipeline.window)
            if self.shared is not None:
                await self._push_hints()  # what was applied or noted: the next leader does not repeat it
        self.ticks += 1

    async def _adopt_incidents(self, ledger: Ledger) -> int:
        """Take over the incidents earlier leaders named (the ledger's `incident.<id>` records):
        a finding read again joins its incident under the same id and role, and its alerts go to
        the same team."""
        from gpuvigil.pipeline.incidents import Placement

        records = await ledger.load_incidents()
        self.pipeline.incidents.adopt({fid: Placement(r["incident"], r["role"], float(r["opened_at"])) for fid, r in records.items()})
        if self.pusher is not None:
            self.pusher.adopt_incident_teams({r["incident"]: r["team"] for r in records.values() if r["team"]})
        if records:
            log.info("act %s: %d finding(s) of earlier leaders' incidents adopted", self.id, len(records))
        return len(records)

    async def _push_hints(self) -> bool:
        try:
            await self.shared.push()  # type: ignore[union-attr]
        except Exception as exc:  # noqa: BLE001 - NATS cannot take them now: nothing is applied until it can
            log.warning("act %s: the fleet's hint store cannot take this tick's hints (%s); applying nothing until it can", self.id, exc)
            return False
        return True

    async def _take_office(self, ledger: Ledger, leases: Leases) -> asyncio.Future:
        """A new leader loads what earlier leaders left (hints, paged incidents) before it ticks,
        serves or sends anything, then reads the findings and cluster streams."""
        self.leader_since = time.monotonic()
        log.warning("act %s: leader now", self.id)
        print(f"gpuvigil act {self.id}: leader", flush=True)
        self.stats.leader_terms += 1
        self._open_outputs()
        if self.store is not None:
            from gpuvigil.fleet.hints import SharedHints

            self.shared = SharedHints(ledger.kv, self.store, self.stats.hint_store)
            await self._while_leader(leases, self.shared.load, "cannot load the fleet's hint store yet")
        await self._while_leader(leases, lambda: self._adopt_incidents(ledger), "cannot read the ledger's incidents yet")
        return asyncio.gather(
            self._read(self.subjects.findings_stream, f"{self.subjects.prefix}.findings.>", self._on_findings, "findings"),
            self._read(self.subjects.cluster_stream, f"{self.subjects.prefix}.cluster.>", self._on_cluster, "cluster"),
        )

    async def _while_leader(self, leases: Leases, step: Any, failing: str) -> None:
        """Retries `step` until it succeeds, this replica stops leading, or it is asked to stop."""
        while leases.valid(LEADER_KEY) and not self.stop_event.is_set():
            try:
                await step()
                return
            except Exception as exc:  # noqa: BLE001 - NATS failing over: retried
                log.warning("act %s: %s: %s", self.id, failing, exc)
                await asyncio.sleep(0.5)

    def _stand_down(self, reader: asyncio.Future | None) -> None:
        """Lost the lease (NATS unreachable for a TTL, or taken): stop acting at once."""
        log.error("act %s: lost the leader lease; standing by", self.id)
        self.leader_since = None
        if reader is not None:
            reader.cancel()
        self.stats.end_term(self)
        self.close()
        self.sinks = []
        self.acting = None
        self.pusher = None
        self.store = self.shared = None


    async def run(self) -> None:
        nc = await connection.connect(self.fleet, f"gpuvigil-act-{self.id}", role=NAME)
        self.js = nc.jetstream(timeout=5)
        reader: asyncio.Task | None = None
        try:
            await transport.ensure(self.js, self.fleet)
            await self.clock.subscribe(nc, self.subjects)
            self.leases = leases = Leases(await self.js.key_value(self.subjects.leases_bucket), self.id, self.fleet.lease_ttl_seconds)
            self.ledger = ledger = Ledger(await self.js.key_value(self.subjects.ledger_bucket), self.id)
            renew_every = self.fleet.lease_ttl_seconds / 4
            # What a new leader opens (the pusher, the hint store and its API, the acting adapters)
            # is imported now, while nothing is held: imported on taking office, it held the event
            # loop for seconds on a loaded machine, longer than a short lease lives unrenewed.
            await asyncio.to_thread(_import_leader_modules)
            state = {"leader": False}

            async def keep_lease() -> None:
                # Its own task: a slow tick or ledger round trip never delays the renewal.
                while True:
                    state["leader"] = await leases.renew(LEADER_KEY) if LEADER_KEY in leases.revision else await leases.take(LEADER_KEY)
                    await asyncio.sleep(renew_every)

            lease_task = asyncio.create_task(keep_lease())
            deadline = time.monotonic() + self.args.duration if self.args.duration else None
            term_epoch: int | None = None
            while not self.stop_event.is_set() and (deadline is None or time.monotonic() < deadline):
                # A renewal merely late (a NATS node lost, a stream leader being elected, a starved
                # process) pauses the leader: it acts on nothing until the lease is valid again
                # (below), but keeps its term. The term ends only when the lease is lost (another
                # holds it) or was taken again after it expired (another may have led meanwhile).
                leader = state["leader"] and leases.valid(LEADER_KEY)
                if self.leader_since is not None and (LEADER_KEY not in leases.revision or leases.epoch.get(LEADER_KEY) != term_epoch):
                    self._stand_down(reader)
                    reader = None
                if leader and self.leader_since is None:
                    term_epoch = leases.epoch.get(LEADER_KEY)
                    reader = await self._take_office(ledger, leases)
                if self.leader_since is not None and leases.valid(LEADER_KEY):
                    now = self.clock.now
                    if math.isfinite(now) and now - self.last_tick >= self.pipeline.config.tick_seconds:
                        self.last_tick = now
                        try:
                            await self._tick(now, ledger)
                        except Exception:  # noqa: BLE001 - act must keep paging: loud, retried next tick
                            log.exception("act %s: tick at %.1f FAILED", self.id, now)
                try:
                    await asyncio.wait_for(self.stop_event.wait(), 0.1)
                except TimeoutError:
                    pass
            lease_task.cancel()
            if reader is not None:
                reader.cancel()
            # The lease released at once hands over to a standby (bounded: SIGTERM exits within 5 s).
            await transport.shutdown(nc, *([leases.release(LEADER_KEY)] if LEADER_KEY in leases.revision else []))
        finally:
            if reader is not None:
                reader.cancel()
            await transport.shutdown(nc)


def run(args: argparse.Namespace) -> int:
    from gpuvigil.util.logsetup import configure as configure_logging

    configure_logging(args.log_level)
    from gpuvigil.fleet.metrics import act_families, endpoint

    a = Act(args)

    async def main() -> None:
        install_signals(asyncio.get_running_loop(), a.stop_event)
        print(f"gpuvigil act {a.id}: standing by for the leader lease; NATS {', '.join(a.fleet.servers)}", flush=True)
        await a.run()

    left = 0
    with endpoint("act", a.id, lambda: act_families(a), args.metrics_host, args.metrics_port) as a.metrics_port:
        try:
            asyncio.run(main())
        finally:
            if a.pusher is not None and a.closers:
                left = a.pusher.pending()
            a.close()
    print(f"gpuvigil act {a.id}: stopped" + (f"; {left} alert(s) left in the outbox" if left else ""), flush=True)
    return 0


__all__ = ["Act", "Ledger", "Relay"]
