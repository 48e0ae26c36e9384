"""Bearer-token auth for the feedback API, and the rules for when it may start without one."""

from __future__ import annotations

import hmac
import ipaddress
import os
from collections.abc import Mapping
from pathlib import Path

from fastapi import HTTPException, Security, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from gpuvigil.errors import UserError

TOKEN_ENV = "GPUVIGIL_API_TOKEN"
# Long enough that guessing is hopeless; `openssl rand -hex 32` gives 64.
MIN_TOKEN_CHARS = 16


def _check_token(token: str, where: str) -> str:
    token = token.strip()
    if not token:
        raise UserError(f"{where}: API token is empty")
    if len(token) < MIN_TOKEN_CHARS:
        raise UserError(f"{where}: API token is {len(token)} characters; use at least {MIN_TOKEN_CHARS} (e.g. `openssl rand -hex 32`)")
    if any(c.isspace() for c in token):
        raise UserError(f"{where}: API token must not contain whitespace")
    return token


def resolve_token(token_file: str | Path | None = None, env: Mapping[str, str] | None = None) -> str | None:
    """The configured token: `--token-file` wins over $GPUVIGIL_API_TOKEN; None if neither."""
    env = os.environ if env is None else env
    if token_file is not None:
        path = Path(token_file)
        try:
            text = path.read_text()
        except OSError as exc:
            raise UserError(f"{path}: cannot read token file: {exc.strerror or exc}") from exc
        return _check_token(text, str(path))
    if TOKEN_ENV in env:
        return _check_token(env[TOKEN_ENV], f"${TOKEN_ENV}")
    return None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(host: str, token: str | None, insecure_local: bool) -> None:
    """Refuse to serve hints to the network without a token."""
    if token is None and not insecure_local:
        raise UserError(
            f"no API token configured: set ${TOKEN_ENV} or pass --token-file FILE "
            "(or --insecure-local to serve without auth on 127.0.0.1 only)"
        )
    if insecure_local and not is_loopback(host):
        raise UserError(f"--insecure-local serves on 127.0.0.1 only; refusing to bind {host}")


bearer_scheme = HTTPBearer(auto_error=False, description=f"the token in ${TOKEN_ENV} or --token-file")


def bearer_auth(token: str | None):
    """A FastAPI dependency that admits a request only with `Authorization: Bearer <token>`.

    With `token=None` (only reachable through --insecure-local on loopback) every request passes.
    """
    expected = None if token is None else token.encode()

    async def require_token(credentials: HTTPAuthorizationCredentials | None = Security(bearer_scheme)) -> None:
        if expected is None:
            return
        given = b"" if credentials is None else credentials.credentials.encode()
        # compare_digest takes time independent of where the first difference is.
        if not hmac.compare_digest(given, expected):
            raise HTTPException(
                status_code=status.HTTP_401_UNAUTHORIZED,
                detail="missing bearer token" if credentials is None else "wrong bearer token",
                headers={"WWW-Authenticate": "Bearer"},
            )

    return require_token
