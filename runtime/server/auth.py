"""API-key authentication as ASGI middleware, in front of routing.

Sitting in front of the router is what makes "every route needs the key" true by construction: a
route added later (or FastAPI's own /docs and /openapi.json) is covered without anyone remembering
to call a check, and an unknown path answers 401 rather than telling a keyless caller which paths
exist. Only the liveness probe stays open, because orchestrators probe it without credentials.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

from runtime.server.errors import ApiError

OPEN_PATHS = frozenset({"/health"})


class BearerAuth:
    def __init__(self, app: ASGIApp, *, api_key: str | None, on_reject: Callable[[Scope, int], None],
                 open_paths: frozenset[str] = OPEN_PATHS) -> None:
        self.app = app
        self.expected = api_key.encode() if api_key is not None else None
        self.on_reject = on_reject
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # Lifespan events carry no credentials; the server has no websocket routes.
        if scope["type"] != "http" or self.expected is None or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        if self.authorized(scope):
            await self.app(scope, receive, send)
            return
        self.on_reject(scope, 401)
        error = ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                         type="authentication_error", code="invalid_api_key")
        await error.response()(scope, receive, send)

    def authorized(self, scope: Scope) -> bool:
        values = [value for name, value in scope["headers"] if name == b"authorization"]
        if len(values) != 1:  # two Authorization headers are ambiguous: refuse rather than pick one
            return False
        scheme, _, token = values[0].partition(b" ")
        # compare_digest: the time taken must not reveal how much of a guessed key was right.
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.expected)
