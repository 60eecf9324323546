"""Servers for the security, limits and fuzz tests: the real CLI as a process with our own
arguments and environment (unlike canary.targets.embedded_server, which always passes --host),
and an app object served by uvicorn on a thread (for test-only apps with a planted bug)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from canary.targets import free_port, wait_healthy

ROOT = Path(__file__).resolve().parents[2]


@contextmanager
def serve_cli(args: list[str], log_path: Path, env: dict[str, str] | None = None,
              startup_timeout_s: float = 120.0) -> Iterator[tuple[str, int]]:
    """`python -m runtime.serve ARGS --port FREE`; yields (loopback root URL, port). Stdout and
    stderr both go to `log_path`, so the file holds everything the process logs."""
    port = free_port()
    cmd = [sys.executable, "-m", "runtime.serve", *args, "--port", str(port)]
    full_env = {**os.environ, "DSV4_NUM_THREADS": "1", **(env or {})}
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=full_env,
                                start_new_session=True)
    root = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(root, proc, startup_timeout_s, log_path)
        yield root, port
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=15)


@contextmanager
def serve_in_thread(app) -> Iterator[str]:
    """Serve an ASGI app (lifespan included, so the engine bridge runs) on a free loopback port."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
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
