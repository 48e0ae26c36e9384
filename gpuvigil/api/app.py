"""The scheduler feedback API (FastAPI): hints to act on, acks/nacks back, node health and job
verdicts, all read from a `HintStore` that a pipeline (this process or another) writes.

`create_app(store, token)` builds the app; `serve_api_in_thread(app, host, port)` runs it with
uvicorn in a background thread (used by `gpuvigil serve` and the tests).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import re
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import uvicorn
from fastapi import APIRouter, Body, Depends, FastAPI, Header, HTTPException, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, Field, field_validator

from gpuvigil.api.auth import bearer_auth, check_bind, is_loopback
from gpuvigil.api.config import ApiConfig, NodeHealthRules, api_config  # noqa: F401 - re-exported
from gpuvigil.api.store import BlankReason, FindingRecord, HintNotFound, HintRecord, HintState, HintStateConflict, HintStore
from gpuvigil.api.quarantine_routes import add_quarantine_routes
from gpuvigil.api.why import WhyProvider, add_why_route
from gpuvigil.errors import UserError
from gpuvigil.model import FindingKind, HintAction, Severity


# -- config: gpuvigil/api/config.py (re-exported here) ---------------------------------------


# -- response models ------------------------------------------------------------------------
class HintList(BaseModel):
    hints: list[HintRecord]
    count: int
    latest_seq: int = Field(description="store change-log position; pass as after_seq to /v1/hints/stream to follow on")


class FindingList(BaseModel):
    findings: list[FindingRecord]
    count: int


def _storable_text(value: str | None) -> str | None:
    # A lone surrogate parses from JSON ("\\ud800") but cannot be stored or sent back as UTF-8.
    if value is not None:
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("text must be valid Unicode (it holds a lone surrogate)") from None
    return value


class AckRequest(BaseModel):
    note: str | None = Field(None, max_length=2000, description="what the scheduler did, e.g. 'drained node-7'")

    _text = field_validator("note")(_storable_text)


class NackRequest(BaseModel):
    reason: str = Field(min_length=1, max_length=2000, description="why the scheduler refuses the hint (not blank)")

    @field_validator("reason")
    @classmethod
    def _not_blank(cls, value: str) -> str:
        _storable_text(value)
        if not value.strip():
            raise ValueError("a nack needs a reason that is not blank")
        return value


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


# The SSE grammar ends a line at CR, LF or CRLF only; str.splitlines() also splits at U+2028,
# U+0085, FF, VT and others, which would cut a JSON string in two `data:` lines.
_SSE_EOL = re.compile(r"\r\n|\r|\n")
MAX_SEQ = 2**63 - 1  # SQLite INTEGER
_LAST_EVENT_ID = re.compile(r"[0-9]{1,19}")  # ASCII digits only: "²".isdigit() is true


def _sse(event: str, data: str, event_id: int | None = None) -> bytes:
    lines = [f"event: {event}"]
    if event_id is not None:
        lines.append(f"id: {event_id}")
    lines.extend(f"data: {line}" for line in _SSE_EOL.split(data))
    return ("\n".join(lines) + "\n\n").encode()


def _json_response(parts: dict[str, Any], raw: dict[str, list[str]]) -> Response:
    """A JSON object from plain values (`parts`) and lists of JSON texts the store built (`raw`),
    without parsing and re-serialising every record."""
    body = json.dumps(parts, separators=(",", ":"))[:-1]
    for key, texts in raw.items():
        body += f',"{key}":[' + ",".join(texts) + "]"
    if not parts:
        body = "{" + body[2:]
    return Response(content=(body + "}").encode(), media_type="application/json")


def _safe_errors(exc: RequestValidationError) -> list[dict[str, Any]]:
    """Validation errors without the offending input: a 50 MB body is not echoed back, and input
    that JSON cannot encode (NaN, lone surrogates) cannot turn a 422 into a 500."""
    out = []
    for err in exc.errors():
        loc = [part if isinstance(part, int) else str(part).encode("utf-8", "replace").decode()[:100] for part in err.get("loc", ())]
        out.append({"loc": loc, "msg": str(err.get("msg", "")).encode("utf-8", "replace").decode()[:300], "type": str(err.get("type", ""))})
    return out


# -- admission: token, then body size, before any route reads the body ------------------------
class BodyTooLarge(HTTPException):
    def __init__(self, limit: int):
        super().__init__(413, f"request body larger than {limit} bytes")


# Read answers that depend only on the store's content, the path and the query string.
_CACHEABLE = re.compile(r"^/v1/(?:hints|findings|nodes/[^/]+/health|jobs/[^/]+/verdict)$")
_JSON_HEADERS = [(b"content-type", b"application/json")]


class ReadCache:
    """Answers of the read endpoints as the bytes that were sent, per store version.

    A hit is answered by the ASGI middleware straight from these bytes: no routing, no query
    parsing, no model validation, no SQL (one `PRAGMA data_version` tells whether the store
    changed). Every write (a pipeline tick, an ack, another process writing the file) starts a
    new version; the first request per path after it is built by the route as usual and kept."""

    MAX_ENTRIES = 8192
    MAX_BYTES = 64 << 20  # a 400-finding verdict is ~330 KB: bound the bytes, not only the count

    def __init__(self, store: HintStore):
        self.store = store
        self._version: Any = None
        self._entries: dict[bytes, bytes] = {}
        self._bytes = 0
        self._lock = threading.Lock()

    def version(self) -> Any:
        return self.store.generation(blocking=False)

    def get(self, key: bytes, version: Any) -> bytes | None:
        with self._lock:
            if version != self._version:
                self._entries.clear()
                self._bytes = 0
                self._version = version
            return self._entries.get(key)

    def put(self, key: bytes, version: Any, body: bytes) -> None:
        with self._lock:
            if version == self._version and len(self._entries) < self.MAX_ENTRIES and self._bytes + len(body) <= self.MAX_BYTES:
                self._bytes += len(body) - len(self._entries.get(key, b""))
                self._entries[key] = body


class Admission:
    """Pure ASGI middleware in front of the app: a /v1 request without the right bearer token is
    answered 401 before a byte of its body is read, and a body over `max_body_bytes` gets 413 as
    soon as its Content-Length or its streamed size says so (never buffered whole). Authorised
    reads of an unchanged store are answered from `cache` (see `ReadCache`)."""

    def __init__(self, app: Callable[..., Awaitable[None]], *, token: str | None, max_body_bytes: int, prefix: str = "/v1", cache: ReadCache | None = None):
        self.app = app
        self.expected = None if token is None else token.encode()
        self.max_body = max_body_bytes
        self.prefix = prefix
        self.cache = cache

    def _auth_error(self, headers: list[tuple[bytes, bytes]]) -> str | None:
        if self.expected is None:
            return None
        value = next((v for k, v in headers if k.lower() == b"authorization"), b"")
        scheme, _, credentials = value.partition(b" ")
        # What fastapi.security.HTTPBearer (the OpenAPI-declared scheme) treats as "no token".
        if not value or not credentials or scheme.lower() != b"bearer":
            return "missing bearer token"
        # compare_digest takes time independent of where the first difference is.
        return None if hmac.compare_digest(credentials, self.expected) else "wrong bearer token"

    @staticmethod
    async def _reply(send: Callable[..., Awaitable[None]], status: int, detail: str, extra: list[tuple[bytes, bytes]] = ()) -> None:
        body = json.dumps({"detail": detail}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), (b"connection", b"close"), *extra]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def _cached_read(self, scope: dict[str, Any], receive: Callable[..., Awaitable[dict]], send: Callable[..., Awaitable[None]], path: str) -> None:
        cache = self.cache
        assert cache is not None
        key = path.encode() + b"?" + scope.get("query_string", b"")
        version = cache.version()
        body = None if version is None else cache.get(key, version)
        if body is not None:
            await send({"type": "http.response.start", "status": 200, "headers": [*_JSON_HEADERS, (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
            return
        status = 0
        chunks: list[bytes] = []

        async def capture(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))
                # Kept (before the last bytes go out, so the next request can hit it) only when
                # the store did not change while the answer was built: the answer then belongs
                # to `version` (a change in between starts a new version; this one is dropped).
                if not message.get("more_body") and status == 200 and version is not None and cache.version() == version:
                    cache.put(key, version, b"".join(chunks))
            await send(message)

        await self.app(scope, receive, capture)

    async def __call__(self, scope: dict[str, Any], receive: Callable[..., Awaitable[dict]], send: Callable[..., Awaitable[None]]) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = scope.get("headers", [])
        path = scope.get("path", "")
        if path == self.prefix or path.startswith(self.prefix + "/"):
            if (why := self._auth_error(headers)) is not None:
                await self._reply(send, 401, why, [(b"www-authenticate", b"Bearer")])
                return
        length = next((v for k, v in headers if k.lower() == b"content-length"), None)
        if self.cache is not None and scope.get("method") == "GET" and length in (None, b"0") and _CACHEABLE.match(path):
            await self._cached_read(scope, receive, send, path)
            return
        if length is not None:
            if not length.isdigit() or len(length) > 18:
                await self._reply(send, 400, "bad Content-Length")
                return
            if int(length) > self.max_body:
                await self._reply(send, 413, f"request body larger than {self.max_body} bytes")
                return
        received = 0
        started = False

        async def limited_receive() -> dict:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body:
                    raise BodyTooLarge(self.max_body)
            return message

        async def tracking_send(message: dict) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyTooLarge:
            if started:
                raise
            await self._reply(send, 413, f"request body larger than {self.max_body} bytes")


# -- app ------------------------------------------------------------------------------------
def create_app(
    store: HintStore,
    token: str | None,
    *,
    insecure_local: bool = False,
    cfg: dict[str, Any] | None = None,
    why: WhyProvider | None = None,
) -> FastAPI:
    """The feedback API over `store`. Every /v1 route needs `Authorization: Bearer <token>`.

    `token=None` is refused unless `insecure_local=True`, and such an app is served on loopback
    only (`serve_api_in_thread` and `gpuvigil api` check the host).
    """
    if token is None and not insecure_local:
        raise UserError("the feedback API needs a token (or insecure_local=True, which serves on 127.0.0.1 only)")
    settings = api_config(cfg)
    app = _base_app(store, token, settings)
    router = APIRouter(prefix="/v1", dependencies=[Depends(bearer_auth(token))])
    page = Query(None, ge=1, le=settings.max_page, description="at most this many results")
    _add_hint_routes(router, store, settings, page)
    _add_hint_stream_route(router, app, store, settings)
    _add_finding_routes(router, store, settings, page)
    _add_health_routes(router, store, settings)
    add_why_route(router, why)  # GET /v1/jobs/{job}/why (gpuvigil/api/why.py)
    add_quarantine_routes(router, store.path, cfg)  # /v1/breaker, /v1/nodes/{node}/quarantine
    app.include_router(router)
    return app


def _base_app(store: HintStore, token: str | None, settings: ApiConfig) -> FastAPI:
    """The app with its state, admission middleware, error handler and /healthz; no /v1 route yet."""
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
    # The token is checked twice: by the Admission middleware before the body is read, and by the
    # route dependency, which also declares the scheme in the OpenAPI document.
    read_cache = ReadCache(store)
    app.state.read_cache = read_cache
    app.add_middleware(Admission, token=token, max_body_bytes=settings.max_body_bytes, cache=read_cache)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(status_code=422, content={"detail": _safe_errors(exc)})

    @app.get("/healthz", response_model=Healthz, tags=["meta"])
    def healthz() -> Healthz:
        return Healthz(ok=True)

    return app


_FINITE = {"allow_inf_nan": False}


async def _cached(key: str, build: Callable[[], Response]) -> Response:
    """Built on a worker thread (SQLite). The bytes are kept per store version by the
    Admission middleware (`ReadCache`), which answers repeats without reaching the route."""
    return await anyio.to_thread.run_sync(build)


def _add_hint_routes(router: APIRouter, store: HintStore, settings: ApiConfig, page: Any) -> None:
    """GET /v1/hints, POST /v1/hints/{hint_id}/ack and /nack."""
    @router.get("/hints", response_model=HintList, tags=["hints"])
    async def list_hints(
        since: float | None = Query(None, **_FINITE, description="only hints changed at or after this wall-clock time (epoch seconds; `updated_wall`)"),
        node: str | None = None,
        job: str | None = None,
        action: HintAction | None = None,
        state: HintState | None = None,
        limit: int | None = page,
    ) -> Response:
        def build() -> Response:
            seq = store.latest_seq()
            hints = store.hints_json(
                since=since,
                node=node,
                job=job,
                action=None if action is None else action.value,
                state=None if state is None else state.value,
                limit=limit or settings.max_page,
            )
            return _json_response({"count": len(hints), "latest_seq": seq}, {"hints": hints})

        return await _cached(json.dumps(["hints", since, node, job, action, state, limit]), build)

    def _transition(fn, hint_id: str, arg: str | None) -> HintRecord:
        try:
            return fn(hint_id, arg)
        except HintNotFound:
            raise HTTPException(404, f"no hint {hint_id}") from None
        except HintStateConflict as exc:
            raise HTTPException(409, str(exc)) from None
        except BlankReason as exc:
            raise HTTPException(422, str(exc)) from None

    hint_id_path = Path(min_length=1, max_length=128, pattern=r"^[0-9A-Za-z_-]+$")

    @router.post("/hints/{hint_id}/ack", response_model=HintRecord, tags=["hints"], responses={404: {}, 409: {}, 413: {}})
    def ack_hint(hint_id: str = hint_id_path, body: AckRequest | None = Body(None)) -> HintRecord:
        """The scheduler applied the hint. Acking an acked hint again is a no-op."""
        return _transition(store.ack, hint_id, None if body is None else body.note)

    @router.post("/hints/{hint_id}/nack", response_model=HintRecord, tags=["hints"], responses={404: {}, 409: {}, 413: {}})
    def nack_hint(body: NackRequest, hint_id: str = hint_id_path) -> HintRecord:
        """The scheduler refuses the hint, with the reason."""
        return _transition(store.nack, hint_id, body.reason)


def _add_hint_stream_route(router: APIRouter, app: FastAPI, store: HintStore, settings: ApiConfig) -> None:
    """GET /v1/hints/stream: server-sent events until the client leaves or the app stops."""

    @router.get(
        "/hints/stream",
        tags=["hints"],
        response_class=StreamingResponse,
        responses={
            200: {"content": {"text/event-stream": {}}, "description": "server-sent events: `hint` events, JSON HintRecord each"},
            400: {"description": "Last-Event-ID is not a change-log position"},
        },
    )
    async def stream_hints(
        request: Request,
        after_seq: int | None = Query(None, ge=0, le=MAX_SEQ, description="replay changes after this change-log position (default: only new ones)"),
        node: str | None = None,
        job: str | None = None,
        action: HintAction | None = None,
        state: HintState | None = None,
        last_event_id: str | None = Header(None, description="set by EventSource on reconnect: resume after it"),
    ) -> StreamingResponse:
        """New and changed hints as they arrive (server-sent events, event `hint`, id = change-log seq).

        Reconnecting with `Last-Event-ID` resumes exactly where the stream left off."""
        if last_event_id is not None and last_event_id.strip():
            if not _LAST_EVENT_ID.fullmatch(last_event_id.strip()) or int(last_event_id) > MAX_SEQ:
                raise HTTPException(400, "Last-Event-ID must be a change-log position (a decimal integer this server sent)")
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


def _add_finding_routes(router: APIRouter, store: HintStore, settings: ApiConfig, page: Any) -> None:
    @router.get("/findings", response_model=FindingList, tags=["findings"])
    async def list_findings(
        since: float | None = Query(None, **_FINITE, description="only findings seen at or after this time (pipeline clock, epoch seconds)"),
        node: str | None = None,
        job: str | None = None,
        kind: FindingKind | None = None,
        severity: Severity | None = None,
        active: bool | None = Query(None, description="true: only findings whose cause is still present"),
        limit: int | None = page,
    ) -> Response:
        def build() -> Response:
            found = store.findings_json(
                since=since,
                node=node,
                job=job,
                kind=None if kind is None else kind.value,
                severity=None if severity is None else severity.value,
                active=active,
                limit=limit or settings.max_page,
            )
            return _json_response({"count": len(found)}, {"findings": found})

        key = json.dumps(["findings", since, node, job, kind, severity, active, limit])
        return await _cached(key, build)


def _add_health_routes(router: APIRouter, store: HintStore, settings: ApiConfig) -> None:
    """GET /v1/nodes/{node}/health and /v1/jobs/{job}/verdict, from the node's or job's active findings."""
    unhealthy = {s.value for s in settings.node_health.unhealthy_severities}
    degraded = {s.value for s in settings.node_health.degraded_severities}

    def _status_of(severities: list[str]) -> str:
        present = set(severities)
        return "unhealthy" if present & unhealthy else "degraded" if present & degraded else "healthy"

    @router.get("/nodes/{node}/health", response_model=NodeHealth, tags=["health"], responses={404: {"description": "gpuvigil never saw this node"}})
    async def node_health(node: str) -> Response:
        """Derived from the node's active findings: any page-severity one → unhealthy, ticket → degraded.
        A node gpuvigil never saw is 404, not healthy."""
        return await _cached(json.dumps(["node", node]), lambda: _node_health(node))

    def _node_health(node: str) -> Response:
        got = store.node_summary(node)
        if not got["findings"] and not store.knows(node=node):
            raise HTTPException(404, f"gpuvigil has never seen node {node!r}")
        rows = got["rows"]
        reasons = [f"{sev} {kind}: {summary}" for sev, kind, summary in rows if sev in unhealthy | degraded]
        return _json_response(
            {"node": node, "status": _status_of([r[0] for r in rows]), "reasons": reasons},
            {"findings": got["findings"], "hints": got["hints"]},
        )

    @router.get("/jobs/{job}/verdict", response_model=JobVerdict, tags=["health"], responses={404: {"description": "gpuvigil never saw this job"}})
    async def job_verdict(job: str) -> Response:
        """What is wrong with the job (worst active finding first), the culprit ranks and nodes,
        and what gpuvigil recommends the scheduler do. A job gpuvigil never saw is 404."""
        return await _cached(json.dumps(["job", job]), lambda: _job_verdict(job))

    def _job_verdict(job: str) -> Response:
        # The store keeps every job's verdict parts up to date as it is written: this is one row.
        got = store.job_summary(job)
        if got is None:
            if not store.knows(job=job):
                raise HTTPException(404, f"gpuvigil has never seen job {job!r}")
            head = {"job": job, "status": "healthy", "summary": "no active findings"}
            return _json_response({**head, "culprit_ranks": [], "culprit_nodes": []}, {"recommended_actions": [], "findings": []})
        n = got["n_findings"]
        summary = f"{got['worst_kind']}: {got['worst_summary']}" + (f" (+{n - 1} more finding(s))" if n > 1 else "")
        head = json.dumps({"job": job, "status": _status_of(got["severities"]), "summary": summary}, separators=(",", ":"))[:-1]
        body = (
            f'{head},"culprit_ranks":{got["culprit_ranks"]},"culprit_nodes":{got["culprit_nodes"]},'
            f'"recommended_actions":{got["hints"]},"findings":{got["findings"]}}}'
        )
        return Response(content=body.encode(), media_type="application/json")


# -- serving --------------------------------------------------------------------------------
def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # Protocol IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY on accepted connections only for a
    # socket whose `proto` says TCP; without it Nagle's algorithm and delayed ACKs add ~40 ms to
    # every response on a reused connection. Set on the listener too (Linux copies it on accept).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise UserError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def make_server(app: FastAPI, *, log_level: str = "warning", tls: tuple[str, str] | None = None) -> uvicorn.Server:
    """`tls`: (certificate file, key file) in PEM; uvicorn wraps the connections in TLS."""
    ssl = {} if tls is None else {"ssl_certfile": tls[0], "ssl_keyfile": tls[1]}
    config = uvicorn.Config(app, log_level=log_level, lifespan="off", timeout_graceful_shutdown=3, access_log=False, **ssl)
    if tls is not None:
        try:
            config.load()  # reads the certificate and key now: a bad file is one line, not a traceback
        except (OSError, ValueError) as exc:
            raise UserError(f"TLS certificate {tls[0]} / key {tls[1]}: {getattr(exc, 'strerror', None) or exc}") from exc
    return uvicorn.Server(config)


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


def serve_api_in_thread(
    app: FastAPI, host: str = "127.0.0.1", port: int = 0, *, log_level: str = "warning", startup_timeout: float = 15.0, tls: tuple[str, str] | None = None
) -> ApiServer:
    """Serve `app` with uvicorn on a background thread; `port=0` picks a free port."""
    if getattr(app.state, "insecure_local", False) and not is_loopback(host):
        raise UserError(f"an API without a token serves on 127.0.0.1 only; refusing to bind {host}")
    server = make_server(app, log_level=log_level, tls=tls)
    sock = bind_socket(host, port)
    bound_port = sock.getsockname()[1]
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name=f"gpuvigil-api:{bound_port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            sock.close()
            raise RuntimeError(f"API server on {host}:{bound_port} did not start")
        time.sleep(0.02)
    api = ApiServer(app, server, thread, sock)
    if tls is not None:
        api.url = "https" + api.url[len("http") :]
    return api


def serve_forever(
    app: FastAPI, host: str, port: int, token: str | None, insecure_local: bool, *, log_level: str = "info", tls: tuple[str, str] | None = None
) -> None:
    check_bind(host, token, insecure_local)
    # Answers not in the read cache are built on worker threads (SQLite, then Python); with the
    # default 5 ms GIL switch interval each of them keeps the event loop, which answers the
    # cached reads in microseconds, waiting up to 5 ms at a time.
    sys.setswitchinterval(0.0005)
    server = make_server(app, log_level=log_level, tls=tls)
    # Our own socket even with TLS: uvicorn's would be made with protocol 0, and asyncio then
    # leaves Nagle on (see bind_socket).
    sock = bind_socket(host, port)
    scheme = "http" if tls is None else "https"
    print(json.dumps({"listening": f"{scheme}://{host}:{sock.getsockname()[1]}", "auth": "none (loopback only)" if token is None else "bearer"}), flush=True)
    server.run(sockets=[sock])
