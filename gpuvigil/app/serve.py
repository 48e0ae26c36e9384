"""`gpuvigil serve`: run collectors, pipeline, detectors and the scheduler loop continuously, and
expose what they see: Prometheus `/metrics`, OTLP push, alerts to Alertmanager (through the
durable outbox) and the scheduler feedback API.

What it reads and what it may do come from the `sources:` section of `--config` (see
`gpuvigil.config.deploy` and deploy/deploy.yaml) or the matching flags: NVML or DCGM, the kernel
log, torch/NCCL logs, Flight Recorder dumps, the in-process hook's receiver, the scheduler's job
map, and `--act off|dry-run|on` for the Slurm/Kubernetes adapters. With nothing configured it
runs the simulated cluster (`--source sim`, the demo); a real source that cannot start is an
error naming it, never a silent switch to simulated data. At start it logs one line per source
(waiting for its first read), then one line per change of state: a source up (after its first
successful read) or down, a finding, an action; `/metrics` exports `gpuvigil_source_up` per source.

The tick loop and metric scrapes share one lock, so a scrape never sees half a tick. SIGTERM or
SIGINT stops the loop, flushes the alert outbox and the OTLP exporter, stops every thread and
exits 0.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any


from gpuvigil import config
from gpuvigil.config import deploy as deployconfig
from gpuvigil.alerts.settings import AlertSettings, load_settings
from gpuvigil.detectors import registry
from gpuvigil.errors import UserError
from gpuvigil.exporter.metrics import Snapshot, TickStats
from gpuvigil.app.serve_memory import HeapTrimmer

log = logging.getLogger("gpuvigil.app.serve")
NAME = "serve"


def add_parser(sub) -> None:
    p = sub.add_parser(NAME, help="run gpuvigil continuously: /metrics, alerts, OTLP, feedback API")
    src = p.add_argument_group("sources (each overrides the same key of the config's `sources:` section)")
    src.add_argument("--source", action="append", choices=["sim", "nvml", "dcgm"], default=None,
                     help="sim (the simulated cluster: the default when nothing else is configured), nvml, dcgm; repeatable")
    deployconfig.add_source_flags(src)  # one per registered source
    src.add_argument("--act", choices=["off", "dry-run", "on"], help="what to do with hints on the scheduler (default dry-run)")
    src.add_argument("--node", help="this node's name as the scheduler knows it (default: the hostname)")
    sim = p.add_argument_group("simulated cluster (--source sim)")
    sim.add_argument("--scenario", default="healthy", help="simulator scenario name or file (default: healthy)")
    sim.add_argument("--nodes", type=int, default=None, help="simulated nodes (default: the scenario's)")
    sim.add_argument("--seed", type=int, default=0, help="simulator seed")
    sim.add_argument("--speed", type=float, default=1.0, help="simulated seconds per wall second (default 1)")
    out = p.add_argument_group("outputs")
    out.add_argument("--host", default="127.0.0.1", help="address for /metrics (default 127.0.0.1)")
    out.add_argument("--port", type=int, default=9400, help="port for /metrics (default 9400; 0 picks a free one)")
    out.add_argument("--alertmanager", action="append", default=None,
                     help="Alertmanager base URL, e.g. http://127.0.0.1:9093: push findings as alerts; repeat for each peer of a "
                          "cluster (default: the config's alerts.alertmanagers)")
    out.add_argument("--outbox", default="gpuvigil-outbox.sqlite", help="SQLite outbox for alerts (default ./gpuvigil-outbox.sqlite)")
    out.add_argument("--otlp-endpoint", help="OTLP/HTTP metrics endpoint, e.g. http://127.0.0.1:4318/v1/metrics")
    out.add_argument("--otlp-interval", type=float, default=15.0, help="seconds between OTLP exports (default 15)")
    api = p.add_argument_group("feedback API")
    api.add_argument("--api-port", type=int, help="also serve the scheduler feedback API on this port")
    api.add_argument("--api-host", default="127.0.0.1", help="address of the feedback API (default 127.0.0.1)")
    api.add_argument("--api-token-file", type=Path, help="bearer token file of the feedback API")
    api.add_argument("--insecure-local", action="store_true", help="feedback API without a token, on 127.0.0.1 only")
    api.add_argument("--api-tls-cert", type=Path, help="serve the feedback API over HTTPS with this PEM certificate (with --api-tls-key)")
    api.add_argument("--api-tls-key", type=Path, help="the certificate's PEM private key")
    api.add_argument("--hint-db", default="gpuvigil-hints.sqlite", help="hint store of the feedback API and of --act (default ./gpuvigil-hints.sqlite)")
    p.add_argument("--config", help="config file (YAML/JSON): thresholds, rules and the `sources:` section (see deploy/deploy.yaml)")
    p.add_argument("--duration", type=float, default=0.0, help="stop after this many wall seconds (default: run until SIGTERM)")
    p.add_argument("--tick-log", type=Path, default=None,
                   help="append one line per tick (for benchmarks): wall time at its end (epoch s), the pipeline's tick duration (s), "
                        "the same with the wait for the tick lock (s), how late it started against the schedule (s)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=run)


def _check_args(args: argparse.Namespace) -> None:
    if not 0 <= args.port <= 65535:
        raise UserError(f"--port {args.port}: must be 0..65535")
    if args.speed <= 0:
        raise UserError(f"--speed {args.speed}: must be > 0")
    if (getattr(args, "api_tls_cert", None) is None) != (getattr(args, "api_tls_key", None) is None):
        raise UserError("--api-tls-cert and --api-tls-key go together")
    if args.duration < 0:
        raise UserError(f"--duration {args.duration}: must be >= 0")
    if args.api_port is not None and args.api_token_file is None and not args.insecure_local and "GPUVIGIL_API_TOKEN" not in os.environ:
        raise UserError("--api-port needs a token: --api-token-file FILE or $GPUVIGIL_API_TOKEN (or --insecure-local for a token-less API on 127.0.0.1)")
    for url in args.alertmanager or ():
        if not url.startswith(("http://", "https://")):
            raise UserError(f"--alertmanager {url!r}: expected an http(s):// URL")


class Server:
    """Everything `serve` runs, startable and stoppable from tests without a subprocess."""

    def __init__(self, args: argparse.Namespace):
        from gpuvigil.config import deploy as deployconfig

        # A detector that misses a declaration (its kind's policy, hint rule, config block) would
        # run half-wired: refuse to start and name what is missing.
        registry.validate()
        _check_args(args)
        self.args = args
        try:
            self.cfg = config.load(args.config)
            self.alert_settings: AlertSettings = load_settings(self.cfg)
        except config.ConfigError as exc:
            raise UserError(str(exc)) from exc
        self.sources_cfg = deployconfig.from_config(self.cfg, args, where=args.config or "config")
        self.simulated = not self.sources_cfg.real
        self.lock = threading.RLock()
        self.stop_event = threading.Event()
        self.stats = TickStats()
        self._stack = ExitStack()
        self.pusher = None
        self.delivery = None
        self.api_server = None
        self.otel = None
        self.metrics_server = None
        self.store = None
        self.acting = None
        self.sources: list[Any] = []
        self.left_in_outbox = 0
        # After each tick: glibc keeps freed memory in its arenas, and RSS wandered 30-90 MB above
        # what was in use at 10k GPUs (serve_memory.py; docs/reliability.md).
        self.trimmer = HeapTrimmer()

    def start(self) -> None:
        try:
            self._start()
        except BaseException:
            self._stack.close()
            raise

    def _start(self) -> None:
        from gpuvigil.app.compose import Outputs

        args = self.args
        outputs = Outputs(stats=self.stats)
        self.alertmanagers = list(args.alertmanager or self.alert_settings.alertmanagers)
        if self.alertmanagers:
            from gpuvigil.alerts.pusher import AlertPusher, DeliveryLoop

            self.pusher = AlertPusher(self.alertmanagers, args.outbox, self.alert_settings)
            self._stack.callback(self.pusher.close)
            self._stack.callback(self._count_left_in_outbox)  # runs after the final flush
            outputs.alerts = self.pusher
            self.delivery = DeliveryLoop(self.pusher).start()
            self._stack.callback(self.delivery.stop)
        src = self.sources_cfg
        acting_wanted = not self.simulated and src.scheduler != "none" and src.act != "off"
        if args.api_port is not None or acting_wanted:
            self.store = self._open_store()
            outputs.store = self.store
        if args.api_port is not None:
            self._start_api(self.store)
        if self.simulated:
            from gpuvigil.app import runtime as runtime_mod

            self.runtime = runtime_mod.build_simulated(args.scenario, nodes=args.nodes, seed=args.seed, cfg=self.cfg, outputs=outputs)
        else:
            self._start_real(outputs)
        extra = [self._source_families, self.trimmer.families]
        if self.pusher is not None:
            from gpuvigil.alerts.pusher import pusher_families

            extra.append(lambda: pusher_families(self.pusher))
        if self.acting is not None:
            extra.append(self.acting.families)
        self.snapshot = Snapshot(self.runtime, self.stats, team_of_tenant=self.alert_settings.team_of_tenant, extra=extra, lock=self.lock)
        from gpuvigil.exporter.prometheus import serve_metrics

        try:
            server, _thread = serve_metrics(self.snapshot, args.port, args.host)
        except OSError as exc:
            raise UserError(f"cannot serve /metrics on {args.host}:{args.port}: {exc.strerror or exc}") from exc
        self.metrics_server = server
        self._stack.callback(server.server_close)
        self._stack.callback(server.shutdown)
        self.metrics_port = server.server_address[1]
        if args.otlp_endpoint:
            from gpuvigil.exporter.otel import otlp_exporter

            self.otel = otlp_exporter(self.snapshot, args.otlp_endpoint, interval_seconds=args.otlp_interval)
            self._stack.callback(self.otel.shutdown)

    def _start_real(self, outputs: Any) -> None:
        from gpuvigil.app import compose
        from gpuvigil.app.runtime import Runtime

        src = self.sources_cfg
        started = compose.start_sources(src, self.cfg)
        self.sources = started.sources
        for s in self.sources:
            self._stack.callback(s.close)
        collectors, scheduler = started.collectors, started.scheduler
        if src.scheduler != "none":
            self.acting = outputs.acting = self._make_acting(src)
        pipeline = compose.build(self.cfg, "serve", collectors, scheduler=scheduler, outputs=outputs, sources=self.sources)
        self.runtime = Runtime(pipeline, scheduler, None, now=time.time())

    def _make_acting(self, src: Any):
        from gpuvigil.app.acting import make_acting

        # The same function builds the `gpuvigil act` leader's (fleet/act.py).
        return make_acting(src.scheduler, src.act, store=self.store, cfg=self.cfg, pager=self.pusher.page if self.pusher is not None else None)

    def _open_store(self):
        from gpuvigil.api import HintStore

        store = HintStore(self.args.hint_db)
        self._stack.callback(store.close)
        return store

    def _start_api(self, store) -> None:
        from gpuvigil.api.auth import check_bind, resolve_token
        from gpuvigil.api.process import ApiProcess

        args = self.args
        token = resolve_token(args.api_token_file)  # the file, else $GPUVIGIL_API_TOKEN
        insecure = args.insecure_local and token is None
        check_bind(args.api_host, token, insecure)
        cert = getattr(args, "api_tls_cert", None)
        tls = None if cert is None else (str(cert), str(args.api_tls_key))
        # Its own process on the same store file: in this one it would wait for the GIL whenever
        # a tick runs Python (gpuvigil/api/process.py).
        if str(store.path) == ":memory:":  # nothing another process could open: served from here
            from gpuvigil.api.app import create_app, serve_api_in_thread

            app = create_app(store, token, insecure_local=insecure, cfg=self.cfg, why=self._why)
            self.api_server = serve_api_in_thread(app, args.api_host, args.api_port, tls=tls)
        else:
            self.api_server = ApiProcess(
                store.path, args.api_host, args.api_port, token=token, insecure_local=insecure, config=args.config, tls=tls, why=self._why_json,
                log_level={"debug": "debug", "error": "error"}.get(args.log_level, "warning"),  # uvicorn's per-request lines stay off at info
            )
        self._stack.callback(self.api_server.stop)

    def _why_json(self, job: str) -> dict[str, Any] | None:
        """`_why` as plain JSON values (it crosses to the API process)."""
        got = self._why(job)
        return None if got is None else json.loads(json.dumps(got, default=str))

    def _why(self, job: str) -> dict[str, Any] | None:
        """GET /v1/jobs/{job}/why: the built-in scheduler's decision records, read under the tick lock."""
        with self.lock:
            runtime = getattr(self, "runtime", None)
            return None if runtime is None else runtime.scheduler.why(job)

    def _source_families(self) -> list[Any]:
        from gpuvigil.exporter.metrics import Family

        up = Family("gpuvigil_source_up", "gauge", "1 if the source's last read worked, 0 if it is down (see serve's log for why).")
        errors = Family("gpuvigil_source_errors", "counter", "Failed reads and dropped records per source.")
        if self.simulated:
            up.add(1, source="sim", where=self.args.scenario)
        for s in self.sources:
            up.add(1 if s.up else 0, source=s.kind, where=s.where)
            if s.collector is not None:
                errors.add(s.collector.errors, source=s.kind, where=s.where)
        return [up, errors]

    def describe(self) -> list[str]:
        """One line per source, for the start-up log."""
        if self.simulated:
            return [f"source sim: scenario {self.args.scenario} x{self.args.speed:g} (simulated data; nothing real is read): up"]
        lines = [s.line() for s in self.sources]
        src = self.sources_cfg
        if src.scheduler != "none":
            lines.append(f"act: {src.act} on {src.scheduler}" + {"off": " (hints are only stored and served)", "dry-run": " (logs and counts what it would do; changes nothing)", "on": " (drains/requeues for real)"}[src.act])
        return lines

    def _count_left_in_outbox(self) -> None:
        self.left_in_outbox = self.pusher.pending() if self.pusher is not None else 0

    def loop(self) -> None:
        """Tick until stopped: every tick_seconds/speed wall seconds (simulated), or every
        tick_seconds of wall time (real sources)."""
        rt = self.runtime
        period = rt.tick_seconds / (self.args.speed if self.simulated else 1.0)
        deadline = time.monotonic() + self.args.duration if self.args.duration else None
        next_tick = time.monotonic()
        tick_log = open(self.args.tick_log, "a", buffering=1) if getattr(self.args, "tick_log", None) else None  # noqa: SIM115 - closed below
        try:
            self._ticks(rt, period, deadline, next_tick, tick_log)
        finally:
            if tick_log is not None:
                tick_log.close()

    def _ticks(self, rt: Any, period: float, deadline: float | None, next_tick: float, tick_log: Any) -> None:
        while not self.stop_event.is_set():
            started = time.monotonic()
            with self.lock:
                if not self.simulated:
                    rt.now = time.time() - rt.tick_seconds
                result = rt.step()
            if tick_log is not None:
                tick_log.write(f"{time.time():.3f} {result.duration_seconds:.4f} {time.monotonic() - started:.4f} {max(0.0, started - next_tick):.3f}\n")
            for finding in result.new_findings:
                log.info("finding %s %s: %s", finding.severity.value, finding.kind.value, finding.summary)
            self._log_levels(result)
            self.trimmer.trim()  # outside the tick lock: scrapes go on meanwhile
            next_tick += period
            if deadline is not None and time.monotonic() >= deadline:
                break
            delay = next_tick - time.monotonic()
            if delay < 0:  # running behind: do not try to catch up in a burst
                next_tick = time.monotonic()
                delay = 0
            self.stop_event.wait(delay)

    def _log_levels(self, result) -> None:
        """Log each job's observation level (docs/levels.md) when first seen and when it changes."""
        levels = getattr(result, "job_levels", None) or {}
        seen = self.__dict__.setdefault("_levels_logged", {})
        changed = {j: lvl for j, lvl in levels.items() if seen.get(j) != lvl}
        if changed:
            log.info("observation level: %s", ", ".join(f"{j} {lvl}" for j, lvl in sorted(changed.items())))
            seen.update(changed)

    def stop(self) -> None:
        self.stop_event.set()

    def close(self) -> None:
        """Stop threads in reverse order of start; the delivery loop's stop flushes the outbox."""
        self._stack.close()


def run(args: argparse.Namespace) -> int:
    from gpuvigil.util.logsetup import configure as configure_logging

    configure_logging(args.log_level)
    server = Server(args)
    server.start()
    previous = {sig: signal.signal(sig, lambda signum, frame: server.stop()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        for line in server.describe():
            log.warning(line) if "DOWN" in line else log.info(line)
        where = f"http://{args.host}:{server.metrics_port}/metrics"
        extras = []
        if server.pusher is not None:
            extras.append(f"alerts → {', '.join(server.alertmanagers)} (outbox {args.outbox})")
        if server.api_server is not None:
            extras.append(f"feedback API {server.api_server.url}")
        if server.otel is not None:
            extras.append(f"OTLP → {args.otlp_endpoint}")
        if server.simulated:
            source = f"scenario {args.scenario} x{args.speed:g}"
        else:
            source = ", ".join(dict.fromkeys(s.kind for s in server.sources)) or "no source"
            if server.acting is not None:
                source += f"; act {server.acting.mode} on {server.acting.scheduler}"
        print(f"gpuvigil serve: {source}; metrics {where}" + "".join(f"; {e}" for e in extras), flush=True)
        server.loop()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        server.close()
        pending = server.left_in_outbox
        print("gpuvigil serve: stopped" + (f"; {pending} alert(s) left in the outbox for the next start" if pending else ""), flush=True)
    return 0
