"""`gpuvigil why JOB`: ask a running feedback API (`gpuvigil serve --api-port`) why the built-in
scheduler placed a job where it is, or why the job still waits, and print it for a human."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any
from urllib.parse import quote

from gpuvigil.api.auth import TOKEN_ENV, resolve_token
from gpuvigil.errors import UserError
from gpuvigil.textsafe import printable

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
    p.add_argument("job", help="job name")
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


def run(args: argparse.Namespace) -> int:
    if not args.job.strip():
        raise UserError("JOB must not be blank")
    if not 0 < args.timeout <= 600:
        raise UserError("--timeout must be in (0, 600] seconds")
    token = resolve_token(args.token_file)
    got = fetch(args.url, args.job, token, args.timeout)
    print(json.dumps(got, indent=2) if args.json else render(got))
    return 0
