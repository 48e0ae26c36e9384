"""/metrics of `gpuvigil detect` and `gpuvigil act` (prometheus_client, own registry, own thread).

The families are built at scrape time from the process's live counters (no copy kept in step
with them). They are read from the HTTP thread while the event loop updates them: plain ints and
small dicts, copied before iterating, so a scrape sees a value at most one update old.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from gpuvigil.errors import UserError


class _Live:
    """A prometheus_client collector whose families come from one function at each scrape."""

    def __init__(self, families: Callable[[], Iterable[Any]]):
        self.families = families

    def collect(self) -> Iterable[Any]:
        return list(self.families())


def serve(families: Callable[[], Iterable[Any]], host: str, port: int) -> tuple[Any, int]:
    """Serve the families on host:port (0: a free port); returns (server, bound port)."""
    from prometheus_client import start_http_server
    from prometheus_client.registry import CollectorRegistry

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Live(families))  # type: ignore[arg-type]
    try:
        server, _thread = start_http_server(port, host, registry)
    except OSError as exc:
        raise UserError(f"cannot serve /metrics on {host}:{port}: {exc.strerror or exc}") from exc
    return server, server.server_address[1]


@contextlib.contextmanager
def endpoint(role: str, ident: str, families: Callable[[], Iterable[Any]], host: str, port: int | None) -> Iterator[int | None]:
    """`--metrics-port` of agent-side processes: serve /metrics for the block (none when port is
    None), print where, and shut the server down on the way out. Yields the bound port."""
    if port is None:
        yield None
        return
    server, bound = serve(families, host, port)
    print(f"gpuvigil {role} {ident}: metrics http://{host}:{bound}/metrics", flush=True)
    try:
        yield bound
    finally:
        server.shutdown()
        server.server_close()


def _gauge(name: str, doc: str, value: float, labels: dict[str, str] | None = None) -> Any:
    from prometheus_client.core import GaugeMetricFamily

    fam = GaugeMetricFamily(name, doc, labels=list(labels or {}))
    fam.add_metric(list((labels or {}).values()), value)
    return fam


def _counter(name: str, doc: str, value: float, labels: dict[str, str] | None = None) -> Any:
    from prometheus_client.core import CounterMetricFamily

    fam = CounterMetricFamily(name, doc, labels=list(labels or {}))
    fam.add_metric(list((labels or {}).values()), value)
    return fam


def _lease_age(leases: Any, key: str) -> float:
    t = leases.renewed_at.get(key) if leases is not None else None
    return time.monotonic() - t if t is not None else math.nan


class ActStats:
    """What `gpuvigil act` counts for /metrics. Per-term objects (pusher, acting) are added to
    the `base_*` counters when a term ends, so the totals never go back."""

    def __init__(self) -> None:
        self.findings_messages = 0
        self.bad_messages = 0
        self.future_messages = 0
        self.newest_findings_now = float("-inf")
        self.pending: dict[str, int] = {"findings": 0, "cluster": 0}
        self.leader_terms = 0
        self.ticks = 0
        self.new_findings: Counter[tuple[str, str]] = Counter()
        self.cleared = 0
        self.pages = 0
        self.last_tick_now = float("-inf")
        self.base_alerts = Counter({"enqueued": 0, "delivered": 0, "failures": 0})
        self.base_acting: Counter[tuple[str, str]] = Counter()
        self.hint_store: Counter[str] = Counter()  # the fleet's hint store (gpuvigil.fleet.hints): loaded, pushed, push_failures

    def on_tick(self, act: Any, result: Any, now: float) -> None:
        from gpuvigil.model import Severity

        self.ticks += 1
        self.last_tick_now = now
        for f in result.new_findings:
            self.new_findings[(f.kind.value, f.severity.value)] += 1
            if f.severity == Severity.PAGE and act.pusher is not None:
                self.pages += 1
        self.cleared += len(result.cleared_findings)

    def alerts(self, act: Any) -> Counter:
        out = Counter(self.base_alerts)
        p = act.pusher
        if p is not None:
            out.update({"enqueued": p.enqueued_total, "delivered": p.delivered_total, "failures": p.delivery_failures_total})
        return out

    def acting(self, act: Any) -> Counter:
        out = Counter(self.base_acting)
        if act.acting is not None:
            out.update(dict(act.acting.counts))
        return out

    def end_term(self, act: Any) -> None:
        self.base_alerts = self.alerts(act)
        self.base_acting = self.acting(act)


def clock_families(role: str, clock: Any, rid: dict[str, str]) -> Iterable[Any]:
    """The bounded data clock (gpuvigil.fleet.clock) of a detect or act replica."""
    from prometheus_client.core import CounterMetricFamily

    yield _gauge(f"gpuvigil_{role}_clock_lag_seconds", "This process's own clock minus the fleet's data clock: how far the fleet's data trails it (NaN before any time).",
                 clock.lag(), rid)
    yield _gauge(f"gpuvigil_{role}_clock_skew_seconds", "The largest offset of a data time heard in the last one to two minutes from this process's own clock (positive: ahead).",
                 clock.skew(), rid)
    fam = CounterMetricFamily(f"gpuvigil_{role}_clock_future_messages", "Messages stamped further ahead of this process's clock than clock_max_skew_seconds: ignored.",
                              labels=["replica", "message"])
    for source, n in sorted(dict(clock.future).items()):
        fam.add_metric([rid["replica"], source], n)
    yield fam


def _from_exporter(families: Iterable[Any], rid: dict[str, str]) -> Iterable[Any]:
    """gpuvigil's own exporter families (gpuvigil.exporter.metrics.Family: gauges and counters)
    as prometheus_client ones, each sample labelled with this replica."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    for fam in families:
        if fam.type not in ("gauge", "counter"):
            continue
        keys = sorted({k for labels, _ in fam.samples for k, _ in labels} | set(rid))
        out = (CounterMetricFamily if fam.type == "counter" else GaugeMetricFamily)(fam.name, fam.help, labels=keys)
        for labels, value in fam.samples:
            d = {**dict(labels), **rid}
            out.add_metric([d.get(k, "") for k in keys], value)
        yield out


def act_families(act: Any) -> Iterable[Any]:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    from gpuvigil.fleet.lease import LEADER_KEY

    s: ActStats = act.stats
    rid = {"replica": act.id}
    # The leader's acting (what it did to the scheduler, quarantine states, the circuit breaker),
    # as `serve` exports it: a standby acts on nothing and exports none.
    acting = getattr(act, "acting", None)
    if acting is not None:
        yield from _from_exporter(acting.families(), rid)
    # A leader whose renewal is late is paused (acts on nothing): not counted as leading meanwhile.
    leader = act.leader_since is not None and act.leases is not None and act.leases.valid(LEADER_KEY)
    yield _gauge("gpuvigil_act_leader", "1 while this replica is the act leader (holds a valid leader lease).", 1.0 if leader else 0.0, rid)
    yield _gauge("gpuvigil_act_lease_held", "1 while this replica holds the act.leader lease and renewed it within the TTL.",
                 1.0 if act.leases is not None and act.leases.valid(LEADER_KEY) else 0.0, rid)
    yield _gauge("gpuvigil_act_lease_renewed_age_seconds", "Seconds since the leader lease was last renewed (NaN when not held).", _lease_age(act.leases, LEADER_KEY), rid)
    yield _counter("gpuvigil_act_leader_terms", "Times this replica became leader.", s.leader_terms, rid)
    yield _counter("gpuvigil_act_ticks", "Ticks of the act Pipeline run as leader.", s.ticks, rid)
    yield _counter("gpuvigil_act_findings_messages", "Findings messages read from the findings stream (as leader).", s.findings_messages)
    yield _counter("gpuvigil_act_bad_messages", "Findings or node-summary messages that could not be decoded.", s.bad_messages)
    fam = CounterMetricFamily("gpuvigil_act_findings", "Findings processed: new findings of the act Pipeline, by kind and severity.", labels=["kind", "severity"])
    for (kind, sev), n in sorted(dict(s.new_findings).items()):
        fam.add_metric([kind, sev], n)
    yield fam
    yield _counter("gpuvigil_act_findings_cleared", "Findings whose cause cleared.", s.cleared)
    yield _gauge("gpuvigil_act_active_findings", "Findings active in the act Pipeline now.", len(act.pipeline.active) if leader else 0)
    yield _counter("gpuvigil_act_pages", "New page-severity findings handed to the Alertmanager pusher.", s.pages)
    al = s.alerts(act)
    yield _counter("gpuvigil_act_alerts_enqueued", "Alerts written to the outbox (firing and resolved).", al["enqueued"])
    yield _counter("gpuvigil_act_alerts_delivered", "Alerts accepted by Alertmanager peers (summed over peers).", al["delivered"])
    yield _counter("gpuvigil_act_alert_delivery_failures", "Failed posts to Alertmanager peers.", al["failures"])
    yield _gauge("gpuvigil_act_alerts_pending", "Alerts in the outbox not yet accepted by every peer.", act.pusher.pending() if act.pusher is not None else 0)
    ledger = act.ledger
    yield _counter("gpuvigil_act_hints_claimed", "Hints this replica claimed in the ledger (issued once, fleet-wide).", ledger.claimed if ledger else 0)
    yield _counter("gpuvigil_act_hints_skipped", "Hints already claimed by another leader or term (not issued again).", ledger.skipped if ledger else 0)
    fam = CounterMetricFamily("gpuvigil_act_hints_applied", "Hints applied or described on the scheduler (act: on / dry-run), by action and outcome.", labels=["action", "outcome"])
    for (action, outcome), n in sorted(s.acting(act).items()):
        fam.add_metric([action, outcome], n)
    yield fam
    lag = act.clock.now - s.last_tick_now if leader and math.isfinite(act.clock.now) and math.isfinite(s.last_tick_now) else math.nan
    yield _gauge("gpuvigil_act_lag_seconds", "Fleet data clock minus the data time of the leader's last tick (NaN when not leader).", lag)
    fam = GaugeMetricFamily("gpuvigil_act_consumer_pending_messages", "Messages the leader's consumer has not read yet, per stream.", labels=["stream"])
    for kind, n in sorted(dict(s.pending).items()):
        fam.add_metric([kind], n if leader else 0)
    yield fam
    yield _gauge("gpuvigil_act_cluster_nodes", "Nodes in the cluster view built from the agents' node summaries.", len(act.cluster.nodes))
    yield _gauge("gpuvigil_act_cluster_pending_jobs", "Pending jobs in the cluster view (the newest queue an agent reported).", len(act.cluster.queue[1]))
    yield _counter("gpuvigil_act_fenced_messages", "Findings messages dropped: stamped with an older partition lease epoch than its newest holder's (a replica that lost the lease).",
                   sum(act.fence.dropped.values()), rid)
    hs = act.stats.hint_store
    yield _counter("gpuvigil_act_hint_store_records_loaded", "Hint records loaded from the fleet's hint store into this replica's copy when it became leader.", hs["loaded"], rid)
    yield _counter("gpuvigil_act_hint_store_records_pushed", "Hint records (new, applied, acked, expired) written to the fleet's hint store.", hs["pushed"], rid)
    yield _counter("gpuvigil_act_hint_store_push_failures", "Ticks whose hints the fleet's hint store could not take (nothing applied on them).", hs["push_failures"], rid)
    yield from clock_families("act", act.clock, rid)


def detect_families(d: Any) -> Iterable[Any]:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    rid = {"replica": d.id}
    parts = list(d.parts.values())
    yield _gauge("gpuvigil_detect_partitions", "Job partitions of the fleet (fleet.partitions): what the replicas together must hold.", d.fleet.partitions, rid)
    yield _gauge("gpuvigil_detect_partitions_held", "Partitions this replica holds a lease on.", len(parts), rid)
    yield _gauge("gpuvigil_detect_partitions_caught_up", "Held partitions whose replay from the stream has caught up.", sum(1 for p in parts if p.caught_up), rid)
    yield _gauge("gpuvigil_detect_member_lease_held", "1 while this replica's membership lease is valid.",
                 1.0 if d.leases is not None and d.leases.valid(f"member.{d.id}") else 0.0, rid)
    yield _counter("gpuvigil_detect_partitions_taken", "Partition leases taken (each one replays the partition).", d.partitions_taken, rid)
    yield _counter("gpuvigil_detect_partitions_lost", "Partition leases lost (not renewed in time, or taken by another replica).", d.partitions_lost, rid)
    yield _counter("gpuvigil_detect_ticks", "Ticks run.", d.ticks, rid)
    yield _counter("gpuvigil_detect_tick_cpu_seconds", "CPU seconds spent in ticks (all partitions).", d.tick_cpu_seconds, rid)
    fam = CounterMetricFamily("gpuvigil_detect_messages", "Rows messages read, per rows stream.", labels=["stream"])
    rows = CounterMetricFamily("gpuvigil_detect_rows", "Job rows read, per rows stream.", labels=["stream"])
    for stream, n in sorted(dict(d.stream_messages).items()):
        fam.add_metric([stream], n)
        rows.add_metric([stream], d.stream_rows.get(stream, 0))
    yield fam
    yield rows
    yield _counter("gpuvigil_detect_bad_messages", "Rows messages that could not be decoded.", sum(p.feed.errors for p in parts))
    pend = GaugeMetricFamily("gpuvigil_detect_consumer_pending_messages", "Messages of a held partition not read yet (its consumer's lag).", labels=["partition", "stream"])
    lag = GaugeMetricFamily("gpuvigil_detect_lag_seconds", "Fleet data clock minus the newest data time read from a held partition.", labels=["partition", "stream"])
    active = GaugeMetricFamily("gpuvigil_detect_active_findings", "Active findings of a held partition.", labels=["partition"])
    for p in sorted(parts, key=lambda x: x.p):
        stream = d.subjects.rows_stream_of(p.p)
        pend.add_metric([str(p.p), stream], p.pending)
        lag.add_metric([str(p.p), stream], d.clock.now - p.newest_now if math.isfinite(p.newest_now) and math.isfinite(d.clock.now) else math.nan)
        active.add_metric([str(p.p)], len(p.pipeline.active))
    yield pend
    yield lag
    yield active
    yield _counter("gpuvigil_detect_findings_published", "Findings messages published to the findings stream.", d.findings_published, rid)
    yield _counter("gpuvigil_detect_fr_dump_requests", "Flight Recorder dump requests sent to the agents of the nodes holding a suspected-hung job's ranks.",
                   d.dumps_asked, rid)
    yield _counter("gpuvigil_detect_fenced_messages", "Findings messages not published: the partition's lease was no longer valid when they were ready.", d.fenced, rid)
    yield _counter("gpuvigil_detect_state_snapshots_written", "Partition state snapshots written to the state bucket (fleet.state_bucket).", d.state_written, rid)
    yield _counter("gpuvigil_detect_state_snapshots_fenced", "Partition state snapshots not written: the lease was no longer valid, or a later owner had written one.", d.state_fenced, rid)
    yield _counter("gpuvigil_detect_state_snapshots_trimmed", "Partition state snapshots over fleet.state_max_bytes, written with the findings only.", d.state_trimmed, rid)
    yield _counter("gpuvigil_detect_state_restored", "Partitions taken over with their state snapshot restored.", d.state_restored, rid)
    ignored = CounterMetricFamily("gpuvigil_detect_state_snapshots_ignored", "State snapshots found at a takeover and not restored, by reason (age, epoch, undecodable).",
                                  labels=["replica", "reason"])
    for reason in ("age", "epoch", "undecodable"):
        ignored.add_metric([d.id, reason], d.state_ignored.get(reason, 0))
    yield ignored
    yield _counter("gpuvigil_detect_lease_writes_recovered", "Lease writes whose acknowledgement was lost (a NATS server died) recognised as this replica's own.",
                   d.leases.adopted if d.leases is not None else 0, rid)
    yield from clock_families("detect", d.clock, rid)
