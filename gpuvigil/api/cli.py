"""`gpuvigil api`: serve the scheduler feedback API over a hint store file."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from gpuvigil import config
from gpuvigil.api.auth import TOKEN_ENV, check_bind, resolve_token
from gpuvigil.config import ConfigError
from gpuvigil.errors import UserError

NAME = "api"


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        NAME,
        help="serve the scheduler feedback API (hints, acks, node health, job verdicts)",
        description=(
            f"Serve the feedback API over a hint store (SQLite) that `gpuvigil serve` writes. "
            f"Bearer-token auth: the token comes from --token-file or ${TOKEN_ENV}; without one the "
            "API refuses to start unless --insecure-local, which serves on 127.0.0.1 only."
        ),
    )
    p.add_argument("--db", required=True, type=Path, help="hint store file (created if missing)")
    p.add_argument("--host", default=None, help="address to listen on (default from config: 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="port (default from config: 8787; 0 picks a free one)")
    p.add_argument("--token-file", type=Path, default=None, help=f"file holding the bearer token (else ${TOKEN_ENV})")
    p.add_argument("--insecure-local", action="store_true", help="no token: serve on 127.0.0.1 only")
    p.add_argument("--config", type=Path, default=None, help="gpuvigil config file (YAML/JSON)")
    p.add_argument("--tls-cert", type=Path, default=None, help="serve HTTPS with this PEM certificate (with --tls-key)")
    p.add_argument("--tls-key", type=Path, default=None, help="the certificate's PEM private key")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    # Used by `gpuvigil serve`, which runs this command as its API process (gpuvigil/api/process.py).
    p.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--why-socket", default=None, help=argparse.SUPPRESS)
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from gpuvigil.api.app import api_config, create_app, serve_forever
    from gpuvigil.api.store import HintStore

    try:
        cfg = config.load(args.config)
        settings = api_config(cfg)
    except ConfigError as exc:
        raise UserError(str(exc)) from exc
    host = args.host or settings.host
    port = settings.port if args.port is None else args.port
    if not 0 <= port <= 65535:
        raise UserError(f"--port {port}: must be 0..65535")
    if (args.tls_cert is None) != (args.tls_key is None):
        raise UserError("--tls-cert and --tls-key go together")
    tls = None if args.tls_cert is None else (str(args.tls_cert), str(args.tls_key))
    token = resolve_token(args.token_file)
    check_bind(host, token, args.insecure_local)  # before touching the store: refuse early
    why = None
    if getattr(args, "parent_pid", None) is not None:
        from gpuvigil.api.process import WHY_KEY_ENV, WhyClient, watch_parent

        watch_parent(args.parent_pid)
        if args.why_socket:
            why = WhyClient(args.why_socket, bytes.fromhex(os.environ.get(WHY_KEY_ENV, "")))
    with HintStore(args.db) as store:
        app = create_app(store, token, insecure_local=args.insecure_local, cfg=cfg, why=why)
        serve_forever(app, host, port, token, args.insecure_local, log_level=args.log_level, tls=tls)
    return 0
