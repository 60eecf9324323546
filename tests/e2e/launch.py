"""An app object served by uvicorn on a thread (for test-only apps with a planted bug), and the
server state the CLI builds. The real CLI as a process is `canary.targets.embedded_server`."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from canary.targets import free_port


@contextmanager
def serve_in_thread(app, before_stop_listening=None) -> Iterator[str]:
    """Serve an ASGI app (lifespan included, so the engine bridge runs) on a free loopback port, under
    the server `runtime.serve` runs (`before_stop_listening`: runtime/server/serving.py)."""
    import uvicorn

    from runtime.server.serving import RuntimeServer

    port = free_port()
    server = RuntimeServer(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"),
                           before_stop_listening)
    thread = threading.Thread(target=server.run, name="test-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("in-thread uvicorn did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=15)


def tiny_state(*extra_args: str):
    """A ServerState for tiny-random built exactly as `python -m runtime.serve` builds it."""
    from runtime.serve import build_state, parse_args

    return build_state(parse_args(["--model", "tiny-random", *extra_args]))
