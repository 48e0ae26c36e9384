"""A connection to the fleet's NATS cluster: reconnecting forever, with the TLS and credential of
a role (gpuvigil.fleet.security), and a refused credential an error at once."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from gpuvigil.config.deploy import Fleet
from gpuvigil.errors import UserError
from gpuvigil.fleet.security import connect_options

log = logging.getLogger("gpuvigil.fleet")


async def connect(fleet: Fleet, name: str, first_connect_seconds: float = 60.0, role: str | None = None):
    """A connection that reconnects forever (a NATS node may die; the cluster keeps serving), with
    TLS and the credential of `role` (agent, detect, act) from `fleet` (gpuvigil.fleet.security).
    A refused credential is an error at once: retrying it would only hide it."""
    from gpuvigil.util.extras import require

    require("nats", "gpuvigil agent/detect/act")  # one line naming the extra if nats-py is missing
    import nats.aio.client

    options = connect_options(fleet, role)

    refused: asyncio.Future = asyncio.get_running_loop().create_future()

    async def _error(exc: Exception) -> None:
        log.debug("nats %s: %s", name, exc)
        # nats-py retries a refused connect like an unreachable server: stop it here.
        if _refused(exc) and not refused.done():
            refused.set_result(_refused(exc))

    # A server that dies without closing its connections (power lost, a partition) is noticed by
    # unanswered pings: within about 3/4 of a lease TTL, so the replica moves to another server
    # while its leases are still valid instead of sending renewals into a dead connection.
    ping_every = min(5.0, max(1.0, fleet.lease_ttl_seconds / 4))

    async def _connect(nc: Any) -> Any:
        await nc.connect(
            servers=fleet.servers, name=name, max_reconnect_attempts=-1, reconnect_time_wait=0.5,
            connect_timeout=2, allow_reconnect=True, error_cb=_error, ping_interval=ping_every, max_outstanding_pings=2, **options,
        )
        return nc

    async def _abandon(task: asyncio.Future, nc: Any) -> None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        try:
            await nc.close()
        except Exception:  # noqa: BLE001 - never connected
            pass


    # The first connect is retried too (a fleet's processes may start before NATS is up).
    last: BaseException | None = None
    deadline = asyncio.get_running_loop().time() + first_connect_seconds
    while True:
        client = nats.aio.client.Client()
        task = asyncio.ensure_future(_connect(client))
        done, _ = await asyncio.wait({task, refused}, timeout=max(0.5, deadline - asyncio.get_running_loop().time()),
                                     return_when=asyncio.FIRST_COMPLETED)
        if refused in done:
            await _abandon(task, client)
            raise UserError(f"NATS at {', '.join(fleet.servers)} refused {name}: {refused.result()}")
        if task not in done:
            await _abandon(task, client)
            raise UserError(f"cannot reach NATS at {', '.join(fleet.servers)} in {first_connect_seconds:g}s: {last or 'no answer'}")
        exc = task.exception()
        if exc is None:
            return task.result()
        if _refused(exc):
            raise UserError(f"NATS at {', '.join(fleet.servers)} refused {name}: {_refused(exc)}")
        last = exc
        if asyncio.get_running_loop().time() > deadline:
            raise UserError(f"cannot reach NATS at {', '.join(fleet.servers)}: {last}")
        await asyncio.sleep(0.5)


def _refused(exc: BaseException) -> str:
    """The reason when `exc` (or what it wraps) is an authentication or TLS refusal, else ''."""
    import ssl

    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        text = str(e).lower()
        if isinstance(e, ssl.SSLError) or "authorization" in text or "authentication" in text or "certificate" in text:
            return str(e) or type(e).__name__
        e = e.__cause__ or e.__context__
    return ""
