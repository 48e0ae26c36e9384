"""`gpuvigil breaker status|close`: the acting circuit breaker, for the person on call.

Reads and writes the quarantine file beside the hint store (`--hint-db`, as `serve` and
`gpuvigil act` take it) directly, or, with `--url`, asks a running feedback API (`GET
/v1/breaker`, `POST /v1/breaker/close`, bearer token from --token-file or $GPUVIGIL_API_TOKEN).
A close is seen by the acting loop on its next tick: acting resumes, on live causes only.
"""

from __future__ import annotations

import argparse
import getpass
import json
import time
from pathlib import Path
from typing import Any

from gpuvigil.api.auth import TOKEN_ENV, resolve_token
from gpuvigil.errors import UserError
from gpuvigil.util.textsafe import printable


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("breaker", help="the acting circuit breaker: status, close", description=__doc__.split("\n\n")[1])
    p.add_argument("action", choices=["status", "close"])
    p.add_argument("--hint-db", default="gpuvigil-hints.sqlite", help="the hint store serve/act use; the breaker lives beside it (default ./gpuvigil-hints.sqlite)")
    p.add_argument("--url", default=None, help="ask a running feedback API instead of the file")
    p.add_argument("--token-file", type=Path, default=None, help=f"file holding the bearer token (else ${TOKEN_ENV})")
    p.add_argument("--who", default=None, help="who closes it (default: the login name), recorded in the breaker's log")
    p.add_argument("--note", default="", help="why it is safe to close (recorded)")
    p.add_argument("--scope", default=None, help="one breaker (slurm, kubernetes); default all")
    p.add_argument("--config", default=None, help="config file (for the breaker limits shown)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=run)
    return p


def _api(args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    base = args.url.rstrip("/")
    token = resolve_token(args.token_file)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        if args.action == "status":
            r = httpx.get(f"{base}/v1/breaker", headers=headers, timeout=10)
        else:
            r = httpx.post(f"{base}/v1/breaker/close", headers=headers, timeout=10, json={"who": args.who or getpass.getuser(), "note": args.note, "scope": args.scope})
    except httpx.HTTPError as exc:
        raise UserError(f"cannot reach the feedback API at {base}: {printable(str(exc), 200)}") from exc
    if r.status_code != 200:
        raise UserError(f"the feedback API at {base} answered HTTP {r.status_code}: {printable(r.text, 300)}")
    return r.json()


def _local(args: argparse.Namespace) -> dict[str, Any]:
    from gpuvigil import config
    from gpuvigil.scheduler.quarantine import Breaker, acting_config, breaker_scopes, close_breakers, store_beside

    db = Path(args.hint_db)
    side = db.with_name(db.stem + ".quarantine.db")
    if not side.exists():
        raise UserError(f"{side}: no breaker state (gpuvigil has not acted with --hint-db {db})")
    cfg = acting_config(config.load(args.config)).breaker
    with store_beside(db) as store:
        if args.action == "close":
            return {"closed": close_breakers(store, cfg, who=f"operator:{args.who or getpass.getuser()}", now=time.time(), note=args.note, scope=args.scope)}
        return {"breakers": [Breaker(store, cfg, scope=s).status() for s in breaker_scopes(store) if args.scope in (None, s)]}


def render(got: dict[str, Any], action: str) -> str:
    if action == "close":
        closed = got["closed"]
        return "no breaker was open" if not closed else "\n".join(f"breaker {b['scope']}: closed by {b['closed_by']}; acting resumes on live causes" for b in closed)
    lines = []
    for b in got["breakers"]:
        w = b["taken_in_window"]
        if b["open"]:
            when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(b["opened_at"]))
            top = ", ".join(f"{c} ({n})" for c, n in sorted(b["causes"].items(), key=lambda kv: -kv[1]))
            lines.append(f"breaker {b['scope']}: OPEN since {when}: {b['would_have_nodes']} node(s) would have been drained; causes {top or 'none'}; {b['reason']}")
        else:
            lines.append(f"breaker {b['scope']}: closed ({w['nodes']} node(s), {w['gpus']} GPU(s) taken out in the last {w['window_seconds']:.0f} s; {b['trips']} trip(s) so far)")
    return "\n".join(lines) or "no breaker yet (gpuvigil has not acted)"


def run(args: argparse.Namespace) -> int:
    got = _api(args) if args.url else _local(args)
    print(json.dumps(got, indent=2, sort_keys=True) if args.json else render(got, args.action))
    if args.action == "status":
        return 1 if any(b["open"] for b in got["breakers"]) else 0
    return 0
