"""runtime/server/serving.py: `RuntimeServer` runs its step before it stops listening (a connection
made during the step is accepted), and a forced exit (a second signal) cuts the step short."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest
import uvicorn

from canary.targets import free_port
from runtime.server.serving import RuntimeServer

pytestmark = pytest.mark.unit


async def app(scope, receive, send) -> None:  # a bare ASGI app: 204 to every request
    if scope["type"] == "lifespan":
        while True:
            kind = (await receive())["type"]  # lifespan.startup, then lifespan.shutdown
            await send({"type": f"{kind}.complete"})
            if kind == "lifespan.shutdown":
                return
    await send({"type": "http.response.start", "status": 204, "headers": []})
    await send({"type": "http.response.body", "body": b""})


def accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


class StepAfterListening(RuntimeServer):
    """The planted bug: the step runs once uvicorn has closed the sockets (as an app's lifespan shutdown does)."""

    async def shutdown(self, sockets=None) -> None:
        await uvicorn.Server.shutdown(self, sockets)
        assert self.before_stop_listening is not None
        await self.before_stop_listening()


def serve(step, kind: type[RuntimeServer] = RuntimeServer) -> tuple[RuntimeServer, threading.Thread, int]:
    port = free_port()
    server = kind(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"), step)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    return server, thread, port


@pytest.mark.parametrize("kind", [RuntimeServer, StepAfterListening], ids=["as_built", "step_after_listening"])
def test_the_step_runs_while_the_server_still_listens(kind):
    """Negative control: the step run after uvicorn closed its sockets finds the connection refused."""
    seen: list[bool] = []

    async def step() -> None:
        seen.append(await asyncio.to_thread(accepts, port))

    server, thread, port = serve(step, kind)
    server.should_exit = True
    thread.join(10)
    assert seen == [kind is RuntimeServer] and not accepts(port)


def test_a_forced_exit_cuts_the_step_short():
    async def step() -> None:
        await asyncio.sleep(60)

    server, thread, _ = serve(step)
    started = time.monotonic()
    server.should_exit = True
    time.sleep(0.3)
    server.force_exit = True
    thread.join(10)
    assert not thread.is_alive() and time.monotonic() - started < 5
