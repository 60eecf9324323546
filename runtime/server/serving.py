"""`RuntimeServer`: the uvicorn server `runtime.serve` runs, with one step of the server's own before
it stops listening at a graceful shutdown.

uvicorn's shutdown closes the listening sockets first, then waits for open connections, then runs the
app's lifespan shutdown: the app hears of the shutdown only once new connections are refused. A PD
prefill server must end its KV writes before that: a decode server that gives a room up sends a close
and, finding nothing listening, frees the room's pages after a short settle delay, which is safe only
if no write of this server can still land in them (runtime/disagg/bootstrap.py `drain`).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable

import uvicorn

log = logging.getLogger(__name__)
FORCE_EXIT_POLL_S = 0.1  # how often the shutdown step looks for a second signal (uvicorn's force_exit)
# How long a graceful shutdown lets open connections finish (uvicorn's `timeout_graceful_shutdown`,
# runtime/serve.py), and a PD prefill server's open rooms before that (runtime/disagg/prefill.py `drain`):
# the rooms' requests are among those connections.
GRACEFUL_SHUTDOWN_S = 5


class RuntimeServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config,
                 before_stop_listening: Callable[[], Awaitable[None]] | None = None) -> None:
        super().__init__(config)
        self.before_stop_listening = before_stop_listening

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self.before_stop_listening is not None:
            step = asyncio.ensure_future(self.before_stop_listening())
            while not step.done():
                if self.force_exit:  # a second Ctrl-C / SIGTERM: stop now, as uvicorn does
                    step.cancel()
                    log.warning("forced exit: the server stops listening without finishing its shutdown step")
                    break
                await asyncio.wait({step}, timeout=FORCE_EXIT_POLL_S)
            if step.done() and not step.cancelled() and step.exception() is not None:
                # The shutdown goes on: a server that cannot stop is worse.
                log.error("the step before the server stops listening failed", exc_info=step.exception())
        await super().shutdown(sockets)


def before_stop_listening(state) -> Callable[[], Awaitable[None]] | None:
    """What a server built from `state` (runtime/serve.py `build_state`) does before it stops
    listening: a PD prefill server drains its rooms; the others nothing."""
    return getattr(state.pd, "drain", None) if state.pd is not None else None
