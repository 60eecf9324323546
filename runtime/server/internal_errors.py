"""Unexpected exceptions as ASGI middleware: a 500 that names an error id, and a log line that
says where, never what.

An exception's text can quote the request (the fuzzer's lone surrogate came back inside a
UnicodeEncodeError), so neither the client nor the log at the default level gets it: the client gets
an OpenAI-shaped 500 with an id, the log gets the id, the exception type and the stack frames
(file, line, function). Catching here, inside the app, also keeps the exception from reaching
Starlette's outermost handler, which would re-raise it for uvicorn to log with its message.
"""

from __future__ import annotations

import logging
import secrets
import traceback
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from runtime.server.errors import ApiError

log = logging.getLogger(__name__)


def frames(exc: BaseException) -> str:
    """The traceback without the exception's message: where it happened, not what it carried."""
    return "".join(traceback.format_tb(exc.__traceback__)).rstrip()


class InternalErrors:
    def __init__(self, app: ASGIApp, on_error: Callable[[Scope, int], None] = lambda *_: None) -> None:
        self.app = app
        self.on_error = on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:  # noqa: BLE001 - every unexpected error becomes a 500, never a crash
            error_id = secrets.token_hex(6)
            log.error("internal error %s on %s %s: %s\n%s", error_id, scope.get("method"), scope.get("path"),
                      type(exc).__name__, frames(exc))
            log.debug("internal error %s message: %s", error_id, exc)
            self.on_error(scope, 500)
            if started:
                return  # a streamed response is under way: uvicorn closes the connection
            error = ApiError(500, f"internal error {error_id} ({type(exc).__name__}); the server log has "
                                  "its stack frames under this id", type="server_error")
            await error.response()(scope, receive, send)
