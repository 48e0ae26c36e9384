"""`gpuvigil serve`: run collectors, pipeline, detectors and the scheduler loop continuously, and
expose what they see: Prometheus `/metrics`, OTLP push, alerts to Alertmanager (through the
durable outbox) and the scheduler feedback API.

The tick loop and metric scrapes share one lock, so a scrape never sees half a tick. SIGTERM or
SIGINT stops the loop, flushes the alert outbox and the OTLP exporter, stops every thread and
exits 0.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import polars as pl

from gpuvigil import config
from gpuvigil.alerts.settings import AlertSettings, load_settings
from gpuvigil.errors import UserError
from gpuvigil.exporter.metrics import Snapshot, TickStats
from gpuvigil.scheduler.core import NodeSpec

log = logging.getLogger("gpuvigil.serve")
NAME = "serve"


def add_parser(sub) -> None:
    p = sub.add_parser(NAME, help="run gpuvigil continuously: /metrics, alerts, OTLP, feedback API")
    src = p.add_argument_group("source")
    src.add_argument("--source", choices=["sim", "nvml", "dcgm"], default="sim", help="where samples come from (default: the simulated cluster)")
    src.add_argument("--scenario", default="healthy", help="simulator scenario name or file (default: healthy)")
    src.add_argument("--nodes", type=int, default=None, help="simulated nodes (default: the scenario's)")
    src.add_argument("--seed", type=int, default=0, help="simulator seed")
    src.add_argument("--speed", type=float, default=1.0, help="simulated seconds per wall second (default 1)")
    src.add_argument("--dcgm-url", action="append", default=[], help="dcgm-exporter /metrics URL (repeat for several nodes)")
    out = p.add_argument_group("outputs")
    out.add_argument("--host", default="127.0.0.1", help="address for /metrics (default 127.0.0.1)")
    out.add_argument("--port", type=int, default=9400, help="port for /metrics (default 9400; 0 picks a free one)")
    out.add_argument("--alertmanager", help="Alertmanager base URL, e.g. http://127.0.0.1:9093: push findings as alerts")
    out.add_argument("--outbox", default="gpuvigil-outbox.sqlite", help="SQLite outbox for alerts (default ./gpuvigil-outbox.sqlite)")
    out.add_argument("--otlp-endpoint", help="OTLP/HTTP metrics endpoint, e.g. http://127.0.0.1:4318/v1/metrics")
    out.add_argument("--otlp-interval", type=float, default=15.0, help="seconds between OTLP exports (default 15)")
    api = p.add_argument_group("feedback API")
    api.add_argument("--api-port", type=int, help="also serve the scheduler feedback API on this port")
    api.add_argument("--api-host", default="127.0.0.1", help="address of the feedback API (default 127.0.0.1)")
    api.add_argument("--api-token-file", type=Path, help="bearer token file of the feedback API")
    api.add_argument("--insecure-local", action="store_true", help="feedback API without a token, on 127.0.0.1 only")
    api.add_argument("--hint-db", default="gpuvigil-hints.sqlite", help="hint store of the feedback API (default ./gpuvigil-hints.sqlite)")
    p.add_argument("--config", help="user config file (YAML/JSON)")
    p.add_argument("--duration", type=float, default=0.0, help="stop after this many wall seconds (default: run until SIGTERM)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=run)


def _check_args(args: argparse.Namespace) -> None:
    if not 0 <= args.port <= 65535:
        raise UserError(f"--port {args.port}: must be 0..65535")
    if args.speed <= 0:
        raise UserError(f"--speed {args.speed}: must be > 0")
    if args.duration < 0:
        raise UserError(f"--duration {args.duration}: must be >= 0")
    if args.source == "dcgm" and not args.dcgm_url:
        raise UserError("--source dcgm needs --dcgm-url URL (a dcgm-exporter /metrics endpoint)")
    if args.api_port is not None and args.api_token_file is None and not args.insecure_local and "GPUVIGIL_API_TOKEN" not in os.environ:
        raise UserError("--api-port needs a token: --api-token-file FILE or $GPUVIGIL_API_TOKEN (or --insecure-local for a token-less API on 127.0.0.1)")
    if args.alertmanager and not args.alertmanager.startswith(("http://", "https://")):
        raise UserError(f"--alertmanager {args.alertmanager!r}: expected an http(s):// URL")


def _nodes_from_probe(collectors: list[Any]) -> list[NodeSpec]:
    """Real sources: learn nodes and GPU counts from one first collect."""
    frames = [c.collect(time.time()).get("gpu_samples") for c in collectors]
    frames = [f for f in frames if f is not None and f.height]
    if not frames:
        return [NodeSpec(socket.gethostname(), n_gpus=0)]
    per_node = (
        pl.concat(frames, how="vertical_relaxed")
        .group_by("node")
        .agg(pl.col("gpu").n_unique().alias("n"), pl.col("memory_total_bytes").max().alias("mem"))
        .sort("node")
    )
    return [NodeSpec(str(node), n_gpus=int(n), gpu_memory_bytes=int(mem or 0)) for node, n, mem in per_node.iter_rows()]


def _real_collectors(args: argparse.Namespace) -> list[Any] | None:
    """Collectors for --source nvml/dcgm; None to fall back to the simulator."""
    if args.source == "dcgm":
        from gpuvigil.collectors.dcgm import DcgmCollector

        return [DcgmCollector(url) for url in args.dcgm_url]
    try:
        import gpuvigil.collectors.nvml as nvml
    except ModuleNotFoundError as exc:
        if exc.name != "gpuvigil.collectors.nvml":
            raise
        print("gpuvigil serve: NVML collector not available in this build; using the simulated cluster", file=sys.stderr)
        return None
    unavailable = getattr(nvml, "NvmlUnavailable", RuntimeError)
    try:
        return [nvml.NvmlCollector()]
    except unavailable as exc:
        print(f"gpuvigil serve: NVML unavailable ({exc}); using the simulated cluster", file=sys.stderr)
        return None


class Server:
    """Everything `serve` runs, startable and stoppable from tests without a subprocess."""

    def __init__(self, args: argparse.Namespace):
        _check_args(args)
        self.args = args
        try:
            self.cfg = config.load(args.config)
            self.alert_settings: AlertSettings = load_settings(self.cfg)
        except config.ConfigError as exc:
            raise UserError(str(exc)) from exc
        self.lock = threading.RLock()
        self.stop_event = threading.Event()
        self.stats = TickStats()
        self._stack = ExitStack()
        self.pusher = None
        self.delivery = None
        self.api_server = None
        self.otel = None
        self.metrics_server = None
        self.simulated = True
        self.left_in_outbox = 0

    def start(self) -> None:
        try:
            self._start()
        except BaseException:
            self._stack.close()
            raise

    def _start(self) -> None:
        from gpuvigil import runtime as runtime_mod

        args = self.args
        sinks: list[Any] = [self.stats]
        if args.alertmanager:
            from gpuvigil.alerts.pusher import AlertPusher, DeliveryLoop

            self.pusher = AlertPusher(args.alertmanager, args.outbox, self.alert_settings)
            self._stack.callback(self.pusher.close)
            self._stack.callback(self._count_left_in_outbox)  # runs after the final flush
            sinks.append(self.pusher)
            self.delivery = DeliveryLoop(self.pusher).start()
            self._stack.callback(self.delivery.stop)
        store = None
        if args.api_port is not None:
            store = self._start_api()
            sinks.append(store)
        collectors = None if args.source == "sim" else _real_collectors(args)
        if collectors is None:
            self.runtime = runtime_mod.build_simulated(args.scenario, nodes=args.nodes, seed=args.seed, cfg=self.cfg, sinks=sinks)
        else:
            self.simulated = False
            self.runtime = runtime_mod.build_real(collectors, _nodes_from_probe(collectors), cfg=self.cfg, sinks=sinks, now=time.time())
        extra = []
        if self.pusher is not None:
            from gpuvigil.alerts.pusher import pusher_families

            extra.append(lambda: pusher_families(self.pusher))
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

    def _start_api(self):
        from gpuvigil.api import HintStore
        from gpuvigil.api.app import create_app, serve_api_in_thread
        from gpuvigil.api.auth import resolve_token

        args = self.args
        token = resolve_token(args.api_token_file)  # the file, else $GPUVIGIL_API_TOKEN
        store = HintStore(args.hint_db)
        self._stack.callback(store.close)
        app = create_app(store, token, insecure_local=args.insecure_local and token is None, cfg=self.cfg)
        self.api_server = serve_api_in_thread(app, args.api_host, args.api_port)
        self._stack.callback(self.api_server.stop)
        return store

    def _count_left_in_outbox(self) -> None:
        self.left_in_outbox = self.pusher.pending() if self.pusher is not None else 0

    def loop(self) -> None:
        """Tick until stopped: every tick_seconds/speed wall seconds (simulated), or every
        tick_seconds of wall time (real sources)."""
        rt = self.runtime
        period = rt.tick_seconds / (self.args.speed if self.simulated else 1.0)
        deadline = time.monotonic() + self.args.duration if self.args.duration else None
        next_tick = time.monotonic()
        while not self.stop_event.is_set():
            with self.lock:
                if not self.simulated:
                    rt.now = time.time() - rt.tick_seconds
                result = rt.step()
            for finding in result.new_findings:
                log.info("finding %s %s: %s", finding.severity.value, finding.kind.value, finding.summary)
            next_tick += period
            if deadline is not None and time.monotonic() >= deadline:
                break
            delay = next_tick - time.monotonic()
            if delay < 0:  # running behind: do not try to catch up in a burst
                next_tick = time.monotonic()
                delay = 0
            self.stop_event.wait(delay)

    def stop(self) -> None:
        self.stop_event.set()

    def close(self) -> None:
        """Stop threads in reverse order of start; the delivery loop's stop flushes the outbox."""
        self._stack.close()


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=getattr(logging, args.log_level.upper()), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    server = Server(args)
    server.start()
    previous = {sig: signal.signal(sig, lambda signum, frame: server.stop()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        where = f"http://{args.host}:{server.metrics_port}/metrics"
        extras = []
        if server.pusher is not None:
            extras.append(f"alerts → {args.alertmanager} (outbox {args.outbox})")
        if server.api_server is not None:
            extras.append(f"feedback API {server.api_server.url}")
        if server.otel is not None:
            extras.append(f"OTLP → {args.otlp_endpoint}")
        source = f"scenario {args.scenario} x{args.speed:g}" if server.simulated else args.source
        print(f"gpuvigil serve: {source}; metrics {where}" + "".join(f"; {e}" for e in extras), flush=True)
        server.loop()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        server.close()
        pending = server.left_in_outbox
        print("gpuvigil serve: stopped" + (f"; {pending} alert(s) left in the outbox for the next start" if pending else ""), flush=True)
    return 0
