"""`gpuvigil bench api`: read throughput and latency of the scheduler feedback API.

A hint store holds `--findings` active findings (default 20,000: `--jobs` jobs of equal size,
400 findings each by default, one node per 8 GPUs) and one live hint per finding. The API is
served by `gpuvigil api` in a child process pinned to one core (`sched_setaffinity`), as a
production deployment would run one worker. Client threads in this process keep their
connections open and read, round-robin: job verdicts, node health, the findings of a job, the
newest findings and the newest hints. Reported per endpoint: p50/p99 latency; overall: requests
per second. Targets: p99 < 50 ms on every endpoint and >= 500 requests per CPU-second of one core.

The data is synthetic (shaped like the simulator's findings); what is measured is the API and
its SQLite store, not detection.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
TOKEN = "bench-token-0123456789abcdef"


def fill_store(path: Path, findings: int, per_job: int) -> tuple[list[str], list[str]]:
    from gpuvigil.api.store import HintStore

    fs, hs = make_findings(findings, per_job)
    with HintStore(path) as store:
        for start in range(0, len(fs), 2000):
            store.record(now=1000.0, active_findings=fs[start : start + 2000], new_hints=hs[start : start + 2000])
    return sorted({f.job for f in fs if f.job}), sorted({f.node for f in fs if f.node})


def make_findings(findings: int, per_job: int) -> tuple[list[Any], list[Any]]:
    from gpuvigil.model import Finding, FindingKind, Hint, HintAction, Severity

    jobs = max(1, findings // per_job)
    fs: list[Finding] = []
    hs: list[Hint] = []
    kinds = [(FindingKind.STRAGGLER, Severity.TICKET), (FindingKind.XID, Severity.PAGE), (FindingKind.THERMAL_THROTTLE, Severity.TICKET), (FindingKind.ECC, Severity.PAGE)]
    for i in range(findings):
        job = f"job-{i % jobs:04d}"
        node = f"node-{i // 8:05d}"
        kind, sev = kinds[i % len(kinds)]
        f = Finding(
            kind=kind, severity=sev, ts=1000.0 + i * 1e-3, job=job, node=node, gpu=i % 8, xid=79 if kind == FindingKind.XID else None,
            ranks=[i % per_job], culprit_ranks=[i % per_job], evidence={"culprit_nodes": [node], "value": i * 0.5},
            summary=f"{kind.value} on {node} GPU {i % 8} of {job}", source="bench", cause="hardware",
        )
        fs.append(f)
        hs.append(Hint(action=HintAction.AVOID_GPU, ts=f.ts, reason=f.summary, finding_id=f.id, finding_kind=f.kind, job=job, node=node, gpu=f.gpu))
    return fs, hs


def build_costs(db: Path, jobs: list[str], nodes: list[str], findings: int, per_job: int, rounds: int = 3) -> dict[str, Any]:
    """CPU (process time, so independent of how loaded the machine is) of what a store write
    costs the API and the writer:

    - `miss_cpu_ms`: per endpoint, one answer built with the read cache emptied first (what the
      first request after a write costs), through the whole ASGI app in this process;
    - `hit_cpu_ms`: the same request answered from the read cache;
    - `tick_write_cpu_s`: one pipeline tick's write of every active finding (`HintStore.record`,
      as `gpuvigil serve` writes each tick), which keeps the verdicts up to date."""
    import asyncio

    from gpuvigil.api.app import create_app
    from gpuvigil.api.store import HintStore

    paths = {
        "verdict": [f"/v1/jobs/{j}/verdict" for j in jobs[:20]],
        "node_health": [f"/v1/nodes/{n}/health" for n in nodes[:20]],
        "findings_of_job": [f"/v1/findings?job={j}&limit=100" for j in jobs[:20]],
        "findings_newest": ["/v1/findings?limit=100"] * 5,
        "hints_newest": ["/v1/hints?limit=100"] * 5,
    }
    miss: dict[str, list[float]] = {n: [] for n in paths}
    hit: dict[str, list[float]] = {n: [] for n in paths}
    with HintStore(db) as store:
        app = create_app(store, TOKEN)
        cache = app.state.read_cache

        async def get(url: str) -> int:
            path, _, query = url.partition("?")
            scope = {"type": "http", "method": "GET", "path": path, "raw_path": path.encode(), "query_string": query.encode(), "root_path": "",
                     "scheme": "http", "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 1), "http_version": "1.1",
                     "headers": [(b"host", b"x"), (b"authorization", f"Bearer {TOKEN}".encode())]}
            status = [0]

            async def receive() -> dict:
                return {"type": "http.request", "body": b"", "more_body": False}

            async def send(message: dict) -> None:
                if message["type"] == "http.response.start":
                    status[0] = message["status"]

            await app(scope, receive, send)
            return status[0]

        async def measure() -> None:
            for _ in range(rounds):
                for name, urls in paths.items():
                    for url in urls:
                        with cache._lock:
                            cache._entries.clear()
                        t0 = time.process_time()
                        assert await get(url) == 200, url
                        miss[name].append(time.process_time() - t0)
                        t0 = time.process_time()
                        await get(url)
                        hit[name].append(time.process_time() - t0)

        asyncio.run(measure())
        fs, _ = make_findings(findings, per_job)
        t0 = time.process_time()
        store.record(now=2000.0, active_findings=fs)
        tick = time.process_time() - t0
    return {"miss_cpu_ms": {n: _pct(v) for n, v in miss.items()}, "hit_cpu_ms": {n: _pct(v) for n, v in hit.items()}, "tick_write_cpu_s": tick}


def start_api(db: Path, core: int | None) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "GPUVIGIL_API_TOKEN": TOKEN}
    cmd = [sys.executable, "-m", "gpuvigil", "api", "--db", str(db), "--port", "0", "--log-level", "warning"]
    preexec = (lambda: os.sched_setaffinity(0, {core})) if core is not None and hasattr(os, "sched_setaffinity") else None
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=preexec)
    line = proc.stdout.readline() if proc.stdout else ""
    if not line:
        raise RuntimeError(f"gpuvigil api did not start: {proc.stderr.read() if proc.stderr else ''}")
    return proc, json.loads(line)["listening"]


class RawClient:
    """A minimal HTTP/1.1 keep-alive client over one socket: prebuilt request bytes, a response
    read by its Content-Length. It costs a few tens of microseconds per request, so on a 2-core
    machine the latency measured is the server's, not a Python HTTP client's (httpx costs ~1 ms
    of CPU per request, and 8 threads of it queue on their own GIL)."""

    def __init__(self, url: str, token: str = TOKEN, timeout: float = 30.0):
        import socket
        from urllib.parse import urlsplit

        u = urlsplit(url)
        self.host = u.hostname or "127.0.0.1"
        self.port = u.port or 80
        self.token = token
        self.sock = socket.create_connection((self.host, self.port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""

    def get(self, path: str) -> tuple[int, bytes]:
        req = f"GET {path} HTTP/1.1\r\nHost: {self.host}\r\nAuthorization: Bearer {self.token}\r\n\r\n".encode()
        self.sock.sendall(req)
        while b"\r\n\r\n" not in self.buf:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("server closed the connection")
            self.buf += chunk
        head, _, rest = self.buf.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        status = int(lines[0].split()[1])
        length = next((int(v) for k, _, v in (ln.partition(b":") for ln in lines[1:]) if k.strip().lower() == b"content-length"), 0)
        while len(rest) < length:
            chunk = self.sock.recv(max(65536, length - len(rest)))
            if not chunk:
                raise ConnectionError("server closed the connection")
            rest += chunk
        body, self.buf = rest[:length], rest[length:]
        return status, body

    def close(self) -> None:
        self.sock.close()


def load(url: str, jobs: list[str], nodes: list[str], seconds: float, threads: int, db: Path | None = None, write_every: float = 0.0) -> dict[str, Any]:
    paths = {
        "verdict": lambda i: f"/v1/jobs/{jobs[i % len(jobs)]}/verdict",
        "node_health": lambda i: f"/v1/nodes/{nodes[i % len(nodes)]}/health",
        "findings_of_job": lambda i: f"/v1/findings?job={jobs[i % len(jobs)]}&limit=100",
        "findings_newest": lambda i: "/v1/findings?limit=100",
        "hints_newest": lambda i: "/v1/hints?limit=100",
    }
    names = list(paths)
    lat: dict[str, list[float]] = {n: [] for n in names}
    errors = [0]
    writes = [0]
    lock = threading.Lock()
    stop = time.monotonic() + seconds
    done = threading.Event()

    def worker(k: int) -> None:
        mine: dict[str, list[float]] = {n: [] for n in names}
        client = RawClient(url)
        try:
            i = k
            while time.monotonic() < stop:
                name = names[i % len(names)]
                t0 = time.perf_counter()
                status, _ = client.get(paths[name](i // len(names)))
                mine[name].append(time.perf_counter() - t0)
                if status != 200:
                    with lock:
                        errors[0] += 1
                i += 1
        finally:
            client.close()
        with lock:
            for n in names:
                lat[n].extend(mine[n])

    def writer() -> None:
        # What a pipeline tick does to the API: a write to the store (here one hint note, from
        # another process's connection, as `gpuvigil serve` writes the file `gpuvigil api` reads)
        # starts a new store version, so every cached answer is built again.
        from gpuvigil.api.store import HintStore

        with HintStore(db) as store:
            ids = [h.id for h in store.hints(limit=200)]
            n = 0
            while not done.wait(write_every):
                store.note(ids[n % len(ids)], "bench", f"bench write {n}")
                n += 1
            writes[0] = n

    t0 = time.monotonic()
    ts = [threading.Thread(target=worker, args=(k,)) for k in range(threads)]
    w = threading.Thread(target=writer) if db is not None and write_every > 0 else None
    for t in ts:
        t.start()
    if w is not None:
        w.start()
    for t in ts:
        t.join()
    wall = time.monotonic() - t0
    done.set()
    if w is not None:
        w.join()
    total = sum(len(v) for v in lat.values())
    return {"seconds": wall, "requests": total, "req_per_s": total / wall, "errors": errors[0], "writes": writes[0], "write_every": write_every,
            "latency": {n: _pct(v) for n, v in lat.items()}}


def _pct(values: list[float]) -> dict[str, float]:
    if not values:
        return {"n": 0, "p50_ms": float("nan"), "p99_ms": float("nan"), "max_ms": float("nan")}
    v = sorted(values)
    return {"n": len(v), "p50_ms": 1000 * v[len(v) // 2], "p99_ms": 1000 * v[min(len(v) - 1, int(0.99 * len(v)))], "max_ms": 1000 * v[-1]}


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def latency_on_reused_connection(url: str, job: str, n: int = 200) -> dict[str, float]:
    """One client, one kept-alive connection, sequential requests: what TCP_NODELAY decides."""
    import httpx

    out = []
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}) as client:
        for _ in range(n):
            t0 = time.perf_counter()
            client.get("/healthz")
            out.append(time.perf_counter() - t0)
    return _pct(out)


def run(findings: int, per_job: int, seconds: float, threads: int, core: int | None, write_every: float = 5.0) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "hints.db"
        t0 = time.monotonic()
        jobs, nodes = fill_store(db, findings, per_job)
        fill = time.monotonic() - t0
        costs = build_costs(db, jobs, nodes, findings, per_job)
        proc, url = start_api(db, core)
        try:
            reuse = latency_on_reused_connection(url, jobs[0])
            load(url, jobs, nodes, min(2.0, seconds), threads)  # warm-up: imports, first connections
            cpu0 = cpu_seconds(proc.pid)
            res = load(url, jobs, nodes, seconds, threads, db, write_every)
            res["server_cpu_seconds"] = cpu_seconds(proc.pid) - cpu0
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    # What one core can serve: requests per CPU-second the server spent (independent of how
    # much of the core a loaded machine gave it).
    res["req_per_cpu_second"] = res["requests"] / res["server_cpu_seconds"] if res["server_cpu_seconds"] > 0 else float("nan")
    res["machine"] = _machine()
    res["costs"] = costs
    res.update(findings=findings, per_job=per_job, jobs=len(jobs), nodes=len(nodes), fill_seconds=fill, threads=threads, core=core, healthz_reused_connection=reuse)
    return res


def _machine() -> str:
    """Cores and load average when the run ended (the development machine is shared)."""
    load1, load5, _ = os.getloadavg()
    return f"{os.cpu_count()} cores, load average {load1:.1f} (1 min) / {load5:.1f} (5 min) at the end of the run"


TARGET_P99_MS = 50.0
TARGET_REQ_PER_CPU_SECOND = 500.0


def targets(res: dict[str, Any]) -> list[tuple[str, str, str, bool | None]]:
    """(what, threshold, measured, ok): every endpoint's p50 and p99 latency (wall, so on a loaded
    machine it counts waiting for a core) and one core's capacity."""
    rows: list[tuple[str, str, str, bool | None]] = []
    for name, p in res["latency"].items():
        for q in ("p50", "p99"):
            v = p[f"{q}_ms"]
            measured = v == v and p["n"] > 0  # NaN when the endpoint got no request
            rows.append((f"`{name}` latency, {q}", f"< {TARGET_P99_MS:g} ms", f"{v:.1f} ms" if measured else "–", (v < TARGET_P99_MS) if measured else None))
    cap = res["req_per_cpu_second"]
    rows.append(("requests per CPU-second of the server (one core)", f"≥ {TARGET_REQ_PER_CPU_SECOND:g}", f"{cap:.0f}" if cap == cap else "–", (cap >= TARGET_REQ_PER_CPU_SECOND) if cap == cap else None))
    return rows


def markdown(res: dict[str, Any], cmd: str | None = None) -> str:
    from benchmarks.report import provenance, targets_table

    lines = [
        "## Feedback API reads",
        "",
        provenance(cmd or res.get("command") or "gpuvigil bench api", "**synthetic** hint store (findings shaped like the simulator's; no detection runs): the API and its SQLite store are measured."),
        "",
        *targets_table(targets(res)),
        "",
        f"Hint store with {res['findings']} active findings ({res['jobs']} jobs × {res['per_job']} findings, {res['nodes']} nodes) and one live "
        f"hint per finding (synthetic data: the API and its store are measured, not detection). `gpuvigil api` served from a child "
        f"process pinned to CPU {res['core']}; {res['threads']} client threads in another process, each on its own kept-alive "
        f"connection (a raw-socket HTTP/1.1 client of a few µs per request, so the figures are the server's), {res['seconds']:.0f} s "
        f"after a 2 s warm-up. "
        + (f"Every {res['write_every']:g} s another process writes the store ({res['writes']} writes; as a `gpuvigil serve` tick does), "
           "so each cached answer is built again once per write. " if res.get("writes") else "The store does not change during the run. ")
        + f"Machine: {res.get('machine', 'the shared development machine (2 cores)')}; times are wall-clock and include waiting for a core.",
        "",
        "| endpoint | requests | p50 ms | p99 ms |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name, p in res["latency"].items():
        lines.append(f"| {name} | {p['n']} | {p['p50_ms']:.1f} | {p['p99_ms']:.1f} |")
    c = res.get("costs")
    if c:
        lines += [
            "",
            "What a store write costs, in CPU time (process time: independent of the machine's load). A miss is the first request "
            "after a write, built by the route (the read cache emptied first); a hit is answered from the cache's bytes. "
            f"The writer's side: one tick's write of all {res['findings']} active findings (`HintStore.record`, which also rebuilds the "
            f"verdicts of the jobs it touched) took **{c['tick_write_cpu_s']:.2f} s** of CPU.",
            "",
            "| endpoint | miss CPU p50 / max ms | hit CPU p50 ms |",
            "| --- | ---: | ---: |",
        ]
        for name, p in c["miss_cpu_ms"].items():
            lines.append(f"| {name} | {p['p50_ms']:.2f} / {p['max_ms']:.2f} | {c['hit_cpu_ms'][name]['p50_ms']:.2f} |")
    r = res["healthz_reused_connection"]
    lines += [
        "",
        f"Capacity of one core: **{res['req_per_cpu_second']:.0f} requests per CPU-second** of the server "
        f"({res['requests']} requests, {res['server_cpu_seconds']:.1f} s CPU, {1000 * res['server_cpu_seconds'] / max(1, res['requests']):.2f} ms per request). "
        f"Wall-clock throughput on this machine: {res['req_per_s']:.0f} req/s, {res['errors']} non-200 answers. "
        f"`/healthz` on one reused connection: p50 {r['p50_ms']:.1f} ms, p99 {r['p99_ms']:.1f} ms (TCP_NODELAY set; without it each "
        "response on a reused connection waited ~40 ms for the delayed ACK).",
    ]
    return "\n".join(lines)


def add_parser(sub) -> None:
    p = sub.add_parser("api", help="feedback API read latency and throughput at 20k findings")
    p.add_argument("--findings", type=int, default=20_000)
    p.add_argument("--per-job", type=int, default=400, help="findings per job (the verdict's size)")
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--threads", type=int, default=8, help="client threads")
    p.add_argument("--write-every", type=float, default=5.0, help="seconds between store writes during the run (a tick's effect on the cache; 0: none)")
    p.add_argument("--core", type=int, default=0, help="CPU the server is pinned to (-1: not pinned)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--no-write", action="store_true", help="do not write docs/benchmarks.md")
    p.set_defaults(func=main)


def main(args) -> int:
    from gpuvigil.errors import UserError

    if args.findings < 1 or args.per_job < 1 or args.seconds <= 0 or args.threads < 1 or args.write_every < 0:
        raise UserError("--findings, --per-job, --threads must be >= 1, --seconds > 0 and --write-every >= 0")
    res = run(args.findings, args.per_job, args.seconds, args.threads, None if args.core < 0 else args.core, args.write_every)
    from benchmarks.report import command

    res["command"] = command("api")
    if not args.no_write:
        from benchmarks.report import write_section

        write_section("api", markdown(res))
    print(json.dumps(res, default=float) if args.json else markdown(res))
    return 0
