"""The scheduler feedback API (FastAPI): hints to act on, acks/nacks back, node health and job
verdicts, all read from a `HintStore` that a pipeline (this process or another) writes.

`create_app(store, token)` builds the app; `serve_api_in_thread(app, host, port)` runs it with
uvicorn in a background thread (used by `gpuvigil serve` and the tests).
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
import uvicorn
from fastapi import APIRouter, Body, Depends, FastAPI, Header, HTTPException, Path, Query, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, Field

from gpuvigil import config
from gpuvigil.api.auth import bearer_auth, check_bind, is_loopback
from gpuvigil.api.store import FindingRecord, HintNotFound, HintRecord, HintState, HintStateConflict, HintStore
from gpuvigil.errors import UserError
from gpuvigil.model import FindingKind, HintAction, Severity


# -- config ---------------------------------------------------------------------------------
class NodeHealthRules(BaseModel):
    unhealthy_severities: list[Severity] = [Severity.PAGE]
    degraded_severities: list[Severity] = [Severity.TICKET]


class ApiConfig(BaseModel):
    host: str = "127.0.0.1"
    port: int = Field(8787, ge=0, le=65535)
    max_page: int = Field(5000, ge=1)
    stream_poll_seconds: float = Field(0.25, gt=0, le=10)
    stream_keepalive_seconds: float = Field(15.0, gt=0)
    node_health: NodeHealthRules = NodeHealthRules()
    slurm: dict[str, Any] = Field(default_factory=dict)  # validated by gpuvigil.scheduler.slurm
    kubernetes: dict[str, Any] = Field(default_factory=dict)  # validated by gpuvigil.scheduler.kubernetes


def api_config(cfg: dict[str, Any] | None = None) -> ApiConfig:
    return config.section("api", ApiConfig, cfg)


# -- response models ------------------------------------------------------------------------
class HintList(BaseModel):
    hints: list[HintRecord]
    count: int
    latest_seq: int = Field(description="store change-log position; pass as after_seq to /v1/hints/stream to follow on")


class FindingList(BaseModel):
    findings: list[FindingRecord]
    count: int


class AckRequest(BaseModel):
    note: str | None = Field(None, max_length=2000, description="what the scheduler did, e.g. 'drained node-7'")


class NackRequest(BaseModel):
    reason: str = Field(min_length=1, max_length=2000, description="why the scheduler refuses the hint")


class NodeHealth(BaseModel):
    node: str
    status: str = Field(description="healthy | degraded | unhealthy")
    reasons: list[str] = Field(description="one line per active finding that makes the node less than healthy")
    findings: list[FindingRecord] = Field(description="active findings on the node")
    hints: list[HintRecord] = Field(description="pending or acked hints that target the node")


class JobVerdict(BaseModel):
    job: str
    status: str = Field(description="healthy | degraded | unhealthy")
    summary: str
    culprit_ranks: list[int]
    culprit_nodes: list[str]
    recommended_actions: list[HintRecord] = Field(description="pending or acked hints for the job's active findings")
    findings: list[FindingRecord] = Field(description="active findings of the job, worst first")


class Healthz(BaseModel):
    ok: bool


_SEVERITY_RANK = {Severity.PAGE: 0, Severity.TICKET: 1, Severity.INFO: 2}
_LIVE_STATES = (HintState.PENDING, HintState.ACKED)


def _status(findings: list[FindingRecord], rules: NodeHealthRules) -> str:
    severities = {f.severity for f in findings}
    if severities & set(rules.unhealthy_severities):
        return "unhealthy"
    if severities & set(rules.degraded_severities):
        return "degraded"
    return "healthy"


def _sse(event: str, data: str, event_id: int | None = None) -> bytes:
    lines = [f"event: {event}"]
    if event_id is not None:
        lines.append(f"id: {event_id}")
    lines.extend(f"data: {line}" for line in data.splitlines() or [""])
    return ("\n".join(lines) + "\n\n").encode()


# -- app ------------------------------------------------------------------------------------
def create_app(
    store: HintStore,
    token: str | None,
    *,
    insecure_local: bool = False,
    cfg: dict[str, Any] | None = None,
) -> FastAPI:
    """The feedback API over `store`. Every /v1 route needs `Authorization: Bearer <token>`.

    `token=None` is refused unless `insecure_local=True`, and such an app is served on loopback
    only (`serve_api_in_thread` and `gpuvigil api` check the host).
    """
    if token is None and not insecure_local:
        raise UserError("the feedback API needs a token (or insecure_local=True, which serves on 127.0.0.1 only)")
    settings = api_config(cfg)
    app = FastAPI(
        title="gpuvigil scheduler feedback API",
        version=__import__("gpuvigil").__version__,
        description=(
            "Hints for schedulers (cordon/drain nodes, requeue jobs, allocator settings ...) derived from "
            "gpuvigil findings, with acks/nacks back; node health and job verdicts. Bearer-token auth on /v1."
        ),
    )
    app.state.store = store
    app.state.insecure_local = token is None
    app.state.stopping = threading.Event()
    router = APIRouter(prefix="/v1", dependencies=[Depends(bearer_auth(token))])
    page = Query(None, ge=1, le=settings.max_page, description="at most this many results")

    @app.get("/healthz", response_model=Healthz, tags=["meta"])
    def healthz() -> Healthz:
        return Healthz(ok=True)

    @router.get("/hints", response_model=HintList, tags=["hints"])
    def list_hints(
        since: float | None = Query(None, description="only hints changed at or after this time (epoch seconds)"),
        node: str | None = None,
        job: str | None = None,
        action: HintAction | None = None,
        state: HintState | None = None,
        limit: int | None = page,
    ) -> HintList:
        seq = store.latest_seq()
        hints = store.hints(
            since=since,
            node=node,
            job=job,
            action=None if action is None else action.value,
            state=None if state is None else state.value,
            limit=limit or settings.max_page,
        )
        return HintList(hints=hints, count=len(hints), latest_seq=seq)

    def _transition(fn, hint_id: str, arg: str | None) -> HintRecord:
        try:
            return fn(hint_id, arg)
        except HintNotFound:
            raise HTTPException(404, f"no hint {hint_id}") from None
        except HintStateConflict as exc:
            raise HTTPException(409, str(exc)) from None

    hint_id_path = Path(min_length=1, max_length=128, pattern=r"^[0-9A-Za-z_-]+$")

    @router.post("/hints/{hint_id}/ack", response_model=HintRecord, tags=["hints"], responses={404: {}, 409: {}})
    def ack_hint(hint_id: str = hint_id_path, body: AckRequest | None = Body(None)) -> HintRecord:
        """The scheduler applied the hint. Acking an acked hint again is a no-op."""
        return _transition(store.ack, hint_id, None if body is None else body.note)

    @router.post("/hints/{hint_id}/nack", response_model=HintRecord, tags=["hints"], responses={404: {}, 409: {}})
    def nack_hint(body: NackRequest, hint_id: str = hint_id_path) -> HintRecord:
        """The scheduler refuses the hint, with the reason."""
        return _transition(store.nack, hint_id, body.reason)

    @router.get(
        "/hints/stream",
        tags=["hints"],
        response_class=StreamingResponse,
        responses={200: {"content": {"text/event-stream": {}}, "description": "server-sent events: `hint` events, JSON HintRecord each"}},
    )
    async def stream_hints(
        request: Request,
        after_seq: int | None = Query(None, ge=0, description="replay changes after this change-log position (default: only new ones)"),
        node: str | None = None,
        job: str | None = None,
        action: HintAction | None = None,
        state: HintState | None = None,
        last_event_id: str | None = Header(None, description="set by EventSource on reconnect: resume after it"),
    ) -> StreamingResponse:
        """New and changed hints as they arrive (server-sent events, event `hint`, id = change-log seq).

        Reconnecting with `Last-Event-ID` resumes exactly where the stream left off."""
        if last_event_id is not None and last_event_id.isdigit():
            cursor = int(last_event_id)
        elif after_seq is not None:
            cursor = after_seq
        else:
            cursor = await anyio.to_thread.run_sync(store.latest_seq)

        def wanted(h: HintRecord) -> bool:
            return (
                (node is None or h.node == node)
                and (job is None or h.job == job)
                and (action is None or h.action == action)
                and (state is None or h.state == state)
            )

        async def events() -> AsyncIterator[bytes]:
            nonlocal cursor
            yield b"retry: 2000\n\n"
            last_sent = time.monotonic()
            while not app.state.stopping.is_set():
                if await request.is_disconnected():
                    return
                changed = await anyio.to_thread.run_sync(store.changes_after, cursor)
                for h in changed:
                    cursor = h.seq
                    if wanted(h):
                        yield _sse("hint", h.model_dump_json(), h.seq)
                        last_sent = time.monotonic()
                if not changed:
                    if time.monotonic() - last_sent > settings.stream_keepalive_seconds:
                        yield b": keep-alive\n\n"
                        last_sent = time.monotonic()
                    await asyncio.sleep(settings.stream_poll_seconds)

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @router.get("/findings", response_model=FindingList, tags=["findings"])
    def list_findings(
        since: float | None = Query(None, description="only findings seen at or after this time (epoch seconds)"),
        node: str | None = None,
        job: str | None = None,
        kind: FindingKind | None = None,
        severity: Severity | None = None,
        active: bool | None = Query(None, description="true: only findings whose cause is still present"),
        limit: int | None = page,
    ) -> FindingList:
        found = store.findings(
            since=since,
            node=node,
            job=job,
            kind=None if kind is None else kind.value,
            severity=None if severity is None else severity.value,
            active=active,
            limit=limit or settings.max_page,
        )
        return FindingList(findings=found, count=len(found))

    def _live_hints(**filters: Any) -> list[HintRecord]:
        return [h for h in store.hints(**filters) if h.state in _LIVE_STATES]

    @router.get("/nodes/{node}/health", response_model=NodeHealth, tags=["health"])
    def node_health(node: str) -> NodeHealth:
        """Derived from the node's active findings: any page-severity one → unhealthy, ticket → degraded."""
        active = sorted(store.findings(node=node, active=True), key=lambda f: (_SEVERITY_RANK[f.severity], -f.last_seen))
        status = _status(active, settings.node_health)
        counted = set(settings.node_health.unhealthy_severities) | set(settings.node_health.degraded_severities)
        reasons = [f"{f.severity.value} {f.kind.value}: {f.summary}" for f in active if f.severity in counted]
        return NodeHealth(node=node, status=status, reasons=reasons, findings=active, hints=_live_hints(node=node))

    @router.get("/jobs/{job}/verdict", response_model=JobVerdict, tags=["health"])
    def job_verdict(job: str) -> JobVerdict:
        """What is wrong with the job (worst active finding first), the culprit ranks and nodes,
        and what gpuvigil recommends the scheduler do."""
        active = sorted(store.findings(job=job, active=True), key=lambda f: (_SEVERITY_RANK[f.severity], -f.last_seen))
        ranks = sorted({r for f in active for r in f.culprit_ranks})
        nodes: set[str] = set()
        for f in active:
            evidence_nodes = f.evidence.get("culprit_nodes")
            if isinstance(evidence_nodes, list):
                nodes.update(str(n) for n in evidence_nodes)
            elif f.node:
                nodes.add(f.node)
        finding_ids = {f.id for f in active}
        actions = [h for h in _live_hints(job=job) if h.finding_id in finding_ids]
        actions += [h for fid in sorted(finding_ids) for h in _live_hints(finding_id=fid) if h.job != job]
        if active:
            worst = active[0]
            summary = f"{worst.kind.value}: {worst.summary}" + (f" (+{len(active) - 1} more finding(s))" if len(active) > 1 else "")
        else:
            summary = "no active findings"
        return JobVerdict(
            job=job,
            status=_status(active, settings.node_health),
            summary=summary,
            culprit_ranks=ranks,
            culprit_nodes=sorted(nodes),
            recommended_actions=actions,
            findings=active,
        )

    app.include_router(router)
    return app


# -- serving --------------------------------------------------------------------------------
def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise UserError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def make_server(app: FastAPI, *, log_level: str = "warning") -> uvicorn.Server:
    return uvicorn.Server(
        uvicorn.Config(app, log_level=log_level, lifespan="off", timeout_graceful_shutdown=3, access_log=False)
    )


class ApiServer:
    """A running API server: `.url`, `.port`, `.stop()`."""

    def __init__(self, app: FastAPI, server: uvicorn.Server, thread: threading.Thread, sock: socket.socket):
        self.app, self._server, self._thread, self._sock = app, server, thread, sock
        self.host, self.port = sock.getsockname()[:2]
        self.url = f"http://{'[' + self.host + ']' if ':' in self.host else self.host}:{self.port}"

    def stop(self, timeout: float = 10.0) -> None:
        self.app.state.stopping.set()  # ends open event streams, which would hold shutdown up
        self._server.should_exit = True
        self._thread.join(timeout)
        self._sock.close()

    def __enter__(self) -> ApiServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve_api_in_thread(app: FastAPI, host: str = "127.0.0.1", port: int = 0, *, log_level: str = "warning", startup_timeout: float = 15.0) -> ApiServer:
    """Serve `app` with uvicorn on a background thread; `port=0` picks a free port."""
    if getattr(app.state, "insecure_local", False) and not is_loopback(host):
        raise UserError(f"an API without a token serves on 127.0.0.1 only; refusing to bind {host}")
    sock = bind_socket(host, port)
    bound_port = sock.getsockname()[1]
    server = make_server(app, log_level=log_level)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name=f"gpuvigil-api:{bound_port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            sock.close()
            raise RuntimeError(f"API server on {host}:{bound_port} did not start")
        time.sleep(0.02)
    return ApiServer(app, server, thread, sock)


def serve_forever(app: FastAPI, host: str, port: int, token: str | None, insecure_local: bool, *, log_level: str = "info") -> None:
    check_bind(host, token, insecure_local)
    sock = bind_socket(host, port)
    print(json.dumps({"listening": f"http://{host}:{sock.getsockname()[1]}", "auth": "none (loopback only)" if token is None else "bearer"}), flush=True)
    make_server(app, log_level=log_level).run(sockets=[sock])
