"""API-key checks for the protected routes: `Authorization: Bearer <key>` (the Anthropic routes also take
`x-api-key: <key>`), compared in constant time."""
from __future__ import annotations

import hmac

from fastapi import Request

from server.api_errors import APIError


def _matches(given: str, expected: tuple[bytes, ...]) -> bool:
    # compare_digest on bytes: constant time whatever the content (str would refuse non-ASCII); every key is
    # compared, so the time does not say which one matched
    given_bytes = given.strip().encode()
    return sum(hmac.compare_digest(given_bytes, key) for key in expected) > 0


def _bearer_matches(request: Request, expected: tuple[bytes, ...]) -> bool:
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and _matches(given, expected)


async def check_api_key(request: Request) -> None:
    """FastAPI dependency (async: a plain def would run in the thread pool, a hop per request); a no-op
    when the server runs without --api-key."""
    expected: tuple[bytes, ...] = request.app.state.settings.api_keys
    if not expected:
        return
    if not _bearer_matches(request, expected):
        raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                       code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


async def check_anthropic_api_key(request: Request) -> None:
    """check_api_key for the Anthropic routes: Anthropic's clients send the key as `x-api-key`."""
    expected: tuple[bytes, ...] = request.app.state.settings.api_keys
    if not expected:
        return
    given = request.headers.get("x-api-key")
    if not (given is not None and _matches(given, expected)) and not _bearer_matches(request, expected):
        raise APIError(401, "invalid or missing API key: send 'x-api-key: <key>' (or 'Authorization: Bearer <key>')",
                       code="invalid_api_key")
