"""`gpuvigil why JOB|NODE`: ask a running feedback API (`gpuvigil serve --api-port`) why the built-in
scheduler placed a job where it is, or why the job still waits; or, for a node gpuvigil acted on,
what it did and why: each quarantine state, its causes and every move with who made it (the
quarantine file beside the hint store, through the API or read directly with --hint-db)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote

from gpuvigil.api.auth import TOKEN_ENV, resolve_token
from gpuvigil.errors import UserError
from gpuvigil.util.textsafe import printable

NAME = "why"
DEFAULT_URL = "http://127.0.0.1:8787"


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        NAME,
        help="why the scheduler placed a job where it is, or why it waits",
        description=(
            "Ask the feedback API of a running `gpuvigil serve --api-port` for a job's decision records: "
            "per scheduling cycle, where it was placed and the plugin scores behind it, or why it waits "
            "(the node state, filter or resource that ruled out each node class; the quota, gang, "
            f"reservation or preemption holding it). Token from --token-file or ${TOKEN_ENV}."
        ),
    )
    p.add_argument("job", metavar="NAME", help="a job name, or a node name: what gpuvigil did to the node and why (its quarantine history)")
    p.add_argument("--hint-db", default=None, help="read a node's quarantine history from the file beside this hint store instead of the API")
    p.add_argument("--url", default=DEFAULT_URL, help=f"feedback API base URL (default {DEFAULT_URL})")
    p.add_argument("--token-file", type=Path, default=None, help=f"file holding the bearer token (else ${TOKEN_ENV})")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the API (default 10)")
    p.add_argument("--json", action="store_true", help="print the API's JSON answer")
    p.set_defaults(func=run)
    return p


def fetch(url: str, job: str, token: str | None, timeout: float) -> dict[str, Any]:
    import httpx

    base = url.rstrip("/")
    if not base.startswith(("http://", "https://")):
        raise UserError(f"--url {url!r}: must start with http:// or https://")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    target = f"{base}/v1/jobs/{quote(job, safe='')}/why"
    try:
        r = httpx.get(target, headers=headers, timeout=timeout)
    except httpx.HTTPError as exc:
        raise UserError(f"cannot reach the feedback API at {base}: {type(exc).__name__}: {printable(str(exc) or 'no answer', 200)} (is `gpuvigil serve --api-port` running?)") from exc
    detail = ""
    try:
        body = r.json()
        detail = body.get("detail", "") if isinstance(body, dict) else ""
    except ValueError:
        body = None
    if r.status_code == 404:
        raise UserError(f"job {printable(job, 200)!r}: {printable(detail or 'not found', 300)} ({base})")
    if r.status_code == 401:
        raise UserError(f"the feedback API at {base} refused the token: {printable(detail, 200)} (set ${TOKEN_ENV} or --token-file)")
    if r.status_code != 200 or not isinstance(body, dict):
        raise UserError(f"the feedback API at {base} answered HTTP {r.status_code}: {printable(detail or r.text, 300)}")
    return body


def _rejected_lines(rejected: list[dict[str, Any]]) -> list[str]:
    out = []
    for r in rejected:
        types = ", ".join(f"{printable(t, 40)}: {n}" for t, n in r.get("node_types", {}).items())
        ex = ", ".join(printable(e, 60) for e in r.get("examples", []))
        out.append(f"      - {r['nodes']} node(s) [{types}] ruled out by {printable(r['stage'], 60)}: {printable(r['reason'], 200)} (e.g. {ex})")
    return out


def render(got: dict[str, Any]) -> str:
    share = f" x {got['gpu_milli'] / 1000:.2f}" if got["gpu_milli"] < 1000 else ""
    lines = [
        f"job {printable(got['job'], 200)} ({printable(got['priority'], 20)}, tenant {printable(got['tenant'], 60)}, "
        f"{got['n_gpus']} GPU(s){share}): {printable(got['summary'], 400)}",
    ]
    if got.get("restarts") or got.get("preemptions"):
        lines.append(f"  restarts {got['restarts']}, preemptions {got['preemptions']}")
    if got.get("excluded_nodes"):
        lines.append(f"  excluded nodes: {', '.join(printable(n, 60) for n in got['excluded_nodes'])}")
    if got.get("decisions"):
        lines.append("  decisions (oldest first):")
    for d in got.get("decisions", []):
        when = f"t={d['first_ts']:.0f}" + (f"..{d['ts']:.0f} ({d['cycles']} cycles)" if d["cycles"] > 1 else "")
        lines.append(f"    {when} {d['outcome']}: {printable(d['reason'], 400)}" + (f" [held by: {printable(d['blocker'], 100)}]" if d.get("blocker") else ""))
        if d.get("scores"):
            lines.append("      scores: " + ", ".join(f"{printable(k, 40)} {v:+.4g}" for k, v in d["scores"].items()))
        if d.get("alternatives"):
            lines.append("      next best: " + ", ".join(f"{printable(a['node'], 60)} ({a['score']:+.4g})" for a in d["alternatives"]))
        lines.extend(_rejected_lines(d.get("rejected", [])))
    if got.get("recent_actions"):
        lines.append("  recent actions:")
        for a in got["recent_actions"]:
            lines.append(f"    t={a['ts']:.0f} {printable(a['action'], 40)}" + (f": {printable(a['detail'], 300)}" if a.get("detail") else ""))
    return "\n".join(lines)


def fetch_node(url: str, node: str, token: str | None, timeout: float) -> dict[str, Any] | None:
    """The node's quarantine records from the API, or None (not a node gpuvigil acted on, or no
    answer: the job route then says why)."""
    import httpx

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        r = httpx.get(f"{url.rstrip('/')}/v1/nodes/{quote(node, safe='')}/quarantine", headers=headers, timeout=timeout)
    except httpx.HTTPError:
        return None
    if r.status_code != 200:
        return None
    try:
        body = r.json()
    except ValueError:
        return None
    return body if isinstance(body, dict) and "records" in body else None


def render_node(got: dict[str, Any]) -> str:
    """`gpuvigil why NODE`: each record's state, its causes, and every move with who and why."""
    lines = [f"node {printable(got['node'], 200)}:"]
    for r in got["records"]:
        what = "node" if r.get("gpu") is None else f"GPU {r['gpu']}"
        lines.append(f"  {what}: {r['state']} since {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(r['since']))}" + (f" ({printable(r['applied'], 300)})" if r.get("applied") else ""))
        for c in r.get("causes", {}).values():
            quiet = "active" if c.get("quiet_since") is None else f"quiet since {time.strftime('%H:%M:%SZ', time.gmtime(c['quiet_since']))}"
            lines.append(f"    cause {printable(c['kind'], 40)} {printable(c['finding_id'], 40)} ({quiet}): {printable(c.get('summary', ''), 300)}")
    if got.get("history"):
        lines.append("  history (oldest first):")
    for t in got.get("history", []):
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t["ts"]))
        gpu = "" if t.get("gpu") is None else f" GPU {t['gpu']}"
        ids = f" [{', '.join(t['finding_ids'])}]" if t.get("finding_ids") else ""
        lines.append(f"    {when}{gpu} {t['from_state']} -> {t['to_state']} by {printable(t['who'], 80)} ({printable(t['rule'], 60)}): {printable(t['cause'], 300)}{ids}"
                     + (f"; {printable(t['detail'], 300)}" if t.get("detail") else ""))
    return "\n".join(lines)


def _local_node(hint_db: str, node: str) -> dict[str, Any]:
    from gpuvigil.scheduler.quarantine import QuarantineMachine, store_beside

    db = Path(hint_db)
    side = db.with_name(db.stem + ".quarantine.db")
    if not side.exists():
        raise UserError(f"{side}: no quarantine state (gpuvigil has not acted with --hint-db {db})")
    with store_beside(db) as store:
        got = QuarantineMachine(store).why(node)
    if not got["records"] and not got["history"]:
        raise UserError(f"gpuvigil never took {printable(node, 200)!r} out of service ({side})")
    return got


def run(args: argparse.Namespace) -> int:
    if not args.job.strip():
        raise UserError("NAME must not be blank")
    if not 0 < args.timeout <= 600:
        raise UserError("--timeout must be in (0, 600] seconds")
    if args.hint_db:
        got = _local_node(args.hint_db, args.job)
        print(json.dumps(got, indent=2) if args.json else render_node(got))
        return 0
    token = resolve_token(args.token_file)
    node = fetch_node(args.url, args.job, token, args.timeout)
    if node is not None:
        print(json.dumps(node, indent=2) if args.json else render_node(node))
        return 0
    got = fetch(args.url, args.job, token, args.timeout)
    print(json.dumps(got, indent=2) if args.json else render(got))
    return 0
