"""The acting circuit breaker and the node quarantine records over the feedback API:

- `GET /v1/breaker`: each breaker's state (open, why, what it held back, the window's count);
- `POST /v1/breaker/close` (`{"who": "...", "note": "...", "scope": null}`): a person closes it;
- `GET /v1/nodes/{node}/quarantine`: the node's (and its GPUs') records and their history,
  what `gpuvigil why NODE` prints.

Every /v1 route needs the API's bearer token, the same token that acks and nacks hints. The state
is the quarantine file beside the hint store (`gpuvigil.scheduler.quarantine.store_beside`), written by the
acting loop of `serve` or `gpuvigil act`; a close here is seen by that loop on its next tick.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from fastapi import APIRouter, HTTPException
from pydantic import BaseModel, Field

from gpuvigil.scheduler.quarantine import Breaker, QuarantineMachine, acting_config, breaker_scopes, close_breakers, store_beside


class CloseRequest(BaseModel):
    who: str = Field(min_length=1, max_length=200, description="the person closing it (recorded in the breaker's log)")
    note: str = Field("", max_length=2000)
    scope: str | None = Field(None, description="one breaker (slurm, kubernetes); all open ones if null")


def add_quarantine_routes(router: APIRouter, hint_db: str | Path | None, cfg: dict[str, Any] | None) -> None:
    breaker_cfg = acting_config(cfg).breaker
    opened: dict[str, Any] = {}

    def store() -> Any:
        if hint_db is None or str(hint_db) == ":memory:":
            raise HTTPException(404, "this API serves an in-memory hint store: no quarantine state beside it")
        if "s" not in opened:
            opened["s"] = store_beside(hint_db)
        return opened["s"]

    @router.get("/breaker", tags=["acting"])
    def breaker_status() -> dict[str, Any]:
        s = store()
        now = time.time()
        return {"breakers": [Breaker(s, breaker_cfg, scope=name).status(now) for name in breaker_scopes(s)]}

    @router.post("/breaker/close", tags=["acting"])
    def breaker_close(body: CloseRequest) -> dict[str, Any]:
        closed = close_breakers(store(), breaker_cfg, who=f"operator:{body.who}", now=time.time(), note=body.note, scope=body.scope)
        return {"closed": closed}

    @router.get("/nodes/{node}/quarantine", tags=["acting"])
    def node_quarantine(node: str) -> dict[str, Any]:
        got = QuarantineMachine(store()).why(node)
        if not got["records"] and not got["history"]:
            raise HTTPException(404, f"gpuvigil never took {node!r} out of service")
        return got
