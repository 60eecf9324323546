"""Admission limits as ASGI middleware: header size and concurrent generation requests.

Both answer before the request reaches a handler, with an OpenAI-shaped error: 431 for headers
past `MAX_HEADER_BYTES` (larger ones than the HTTP parser's own buffer are cut off by uvicorn
before we see them) and 429 with Retry-After when `RequestSlots` is full. A slot is held until
the whole response has been sent, streaming included, and is released on every exit path (normal
end, error, client disconnect), because the middleware wraps the complete ASGI call.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

from runtime.server.errors import ApiError

MAX_HEADER_BYTES = 32 * 1024
RETRY_AFTER_S = 1


class RequestSlots:
    """How many generation requests are in flight, against a fixed limit."""

    def __init__(self, limit: int, on_change: Callable[[int], None] = lambda _: None) -> None:
        if limit < 1:
            raise ValueError(f"the concurrent-request limit must be >= 1, got {limit}")
        self.limit = limit
        self.in_flight = 0
        self.on_change = on_change

    def try_acquire(self) -> bool:
        # The event loop is single-threaded and there is no await between test and increment.
        if self.in_flight >= self.limit:
            return False
        self.in_flight += 1
        self.on_change(self.in_flight)
        return True

    def release(self) -> None:
        self.in_flight -= 1
        self.on_change(self.in_flight)


class ConcurrencyLimit:
    def __init__(self, app: ASGIApp, *, slots: RequestSlots, paths: frozenset[str],
                 on_reject: Callable[[Scope, int], None]) -> None:
        self.app = app
        self.slots = slots
        self.paths = paths
        self.on_reject = on_reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in self.paths:
            await self.app(scope, receive, send)
            return
        if not self.slots.try_acquire():
            self.on_reject(scope, 429)
            error = ApiError(429, f"too many concurrent requests (the limit is {self.slots.limit}); retry later",
                             type="rate_limit_error", code="too_many_requests",
                             headers={"Retry-After": str(RETRY_AFTER_S)})
            await error.response()(scope, receive, send)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            self.slots.release()


class HeaderSizeLimit:
    def __init__(self, app: ASGIApp, *, on_reject: Callable[[Scope, int], None],
                 max_bytes: int = MAX_HEADER_BYTES) -> None:
        self.app = app
        self.on_reject = on_reject
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            size = sum(len(name) + len(value) for name, value in scope["headers"])
            if size > self.max_bytes:
                self.on_reject(scope, 431)
                error = ApiError(431, f"request headers of {size} bytes exceed the limit of {self.max_bytes} bytes",
                                 code="request_headers_too_large")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)
