"""Logging of the long-running commands (serve, agent, detect, act): what an on-call engineer reads.

At INFO the log has one line per state change: a source going up or down, a finding, an action.
Libraries that log every request at INFO (httpx: "HTTP Request: GET .../metrics 200 OK" once a
second per dcgm-exporter endpoint; uvicorn's access log) are held to WARNING unless the level is
DEBUG, where their per-request lines help find a misbehaving endpoint.
"""

from __future__ import annotations

import logging
import sys

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# Loggers that write one line per request or connection.
PER_REQUEST_LOGGERS = ("httpx", "httpcore", "uvicorn.access", "urllib3", "hpack")


def configure(level: str = "info") -> None:
    """Root logging to stderr at `level` (debug, info, warning, error); per-request library
    loggers only at debug."""
    numeric = getattr(logging, level.upper())
    logging.basicConfig(level=numeric, format=FORMAT, stream=sys.stderr)
    for name in PER_REQUEST_LOGGERS:
        logging.getLogger(name).setLevel(logging.NOTSET if numeric <= logging.DEBUG else max(numeric, logging.WARNING))
