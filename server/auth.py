"""API-key check for the protected routes: `Authorization: Bearer <key>`, compared in constant time."""
from __future__ import annotations

import hmac

from fastapi import Request

from server.errors import APIError


async def check_api_key(request: Request) -> None:
    """FastAPI dependency (async: a plain def would run in the thread pool, a hop per request); a no-op
    when the server runs without --api-key."""
    expected: bytes | None = request.app.state.settings.api_key_bytes
    if expected is None:
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    # compare_digest on bytes: constant time whatever the content (str would refuse non-ASCII)
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), expected):
        raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                       code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
