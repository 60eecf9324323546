"""`AfterTheStep`: ASGI middleware of the PD prefill server that holds the requests of some paths (a decode
server's room opening, POST /pd/transfer) until the engine's step in flight has ended and handed its tokens over.

Why: the room opening reaches the prefill server while it computes the prompt (the decode server opens it as soon as
it has its pages), and its Python (routing, the JSON body, the room, the streamed answer's start) runs on the event
loop thread while the engine thread launches the prompt step's kernels one by one, each launch taking the GIL back
after its C call. On an H100 the prefill server's prompt step took 0.4-1.2 ms longer than the colocated server's
(forty-second and forty-third sessions, `bench.pd_ttft --phases`). Nothing of the room is on the first token's path
(the first token is relayed by the router), so it can wait for one step; the step's tokens reach the loop first, so
the first token's relay is written before the room's work runs. Requests of other paths, and any request while no
step runs, pass at once. The wait is at most the step in flight (a burst of steps does not starve it).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

# The prefill server's room opening (runtime/disagg/prefill.py `transfer`).
ROOM_OPENING_PATHS = frozenset({"/pd/transfer"})


class AfterTheStep:
    def __init__(self, app: ASGIApp, *, paths: frozenset[str], step_ended: Callable[[], asyncio.Future]) -> None:
        self.app = app
        self.paths = paths
        self.step_ended = step_ended

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] in self.paths:
            await self.step_ended()
        await self.app(scope, receive, send)
