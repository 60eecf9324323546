"""Targets the harness talks to: the embedded runtime (started here on a free port) or any
OpenAI-compatible URL. Both end up as a `Target` with a base URL and a model name."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import httpx


@dataclass(frozen=True)
class Target:
    name: str
    base_url: str  # ends with /v1
    model: str
    embedded: bool
    api_key: str = "EMPTY"
    log_path: Path | None = None
    pid: int | None = None  # the embedded server's process id (the soak samples its memory); None if remote


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(root_url: str, proc: subprocess.Popen | None, timeout_s: float, log_path: Path | None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log_path.read_text()[-3000:] if log_path and log_path.is_file() else ""
            raise RuntimeError(f"embedded server exited with status {proc.returncode} before becoming healthy\n{tail}")
        try:
            if httpx.get(root_url + "/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"server at {root_url} not healthy after {timeout_s:.0f}s")


@contextmanager
def embedded_server(model: str, faults: list[str] = (), max_running: int = 128, num_pages: int = 8192,
                    log_dir: Path | None = None, extra_args: list[str] = (),
                    startup_timeout_s: float = 120.0) -> Iterator[Target]:
    """Start `python -m runtime.serve` on a free loopback port; stop it (and its children) on exit.

    The pool holds every session's whole context at once (80 sessions x a few hundred tokens):
    a smaller pool would turn the gate into a preemption benchmark."""
    port = free_port()
    cmd = [sys.executable, "-m", "runtime.serve", "--model", model, "--host", "127.0.0.1", "--port", str(port),
           "--max-running", str(max_running), "--num-pages", str(num_pages), *extra_args]
    for fault in faults:
        cmd += ["--inject-fault", fault]
    log_dir = log_dir or Path(os.environ.get("TMPDIR", "/tmp"))
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"embedded-server-{port}.log"
    # One torch thread for the engine: the harness (HTTP client, oracles) needs the other core, and
    # two torch threads fighting a busy client thrash (a 21 us matmul took 5 ms that way).
    env = {**os.environ, "DSV4_NUM_THREADS": os.environ.get("DSV4_NUM_THREADS", "1")}
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    root = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(root, proc, startup_timeout_s, log_path)
        yield Target(f"embedded:{Path(model).name}{'+' + '+'.join(faults) if faults else ''}", root + "/v1",
                     Path(model).name if Path(model).exists() else model, True,
                     api_key=api_key_in(extra_args) or "EMPTY", log_path=log_path, pid=proc.pid)
    finally:
        _stop(proc)


def api_key_in(args: list[str]) -> str | None:
    """The key an `--api-key` among the server's arguments sets, so the harness sends it too."""
    for i, arg in enumerate(args):
        if arg.startswith("--api-key="):
            return arg.split("=", 1)[1]
        if arg == "--api-key" and i + 1 < len(args):
            return args[i + 1]
    return None


def _stop(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=grace_s)
    except ProcessLookupError:
        pass


def remote_target(base_url: str, model: str | None, api_key: str | None = None) -> Target:
    base = base_url.rstrip("/")
    if not base.endswith("/v1"):
        base += "/v1"
    if model is None:
        # Ask the server which model it serves, as a convenience for single-model deployments.
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        models = httpx.get(base + "/models", headers=headers, timeout=10.0).json()["data"]
        if len(models) != 1:
            raise ValueError(f"{base} serves {len(models)} models; pass --model")
        model = models[0]["id"]
    return Target(f"remote:{base}", base, model, False, api_key or "EMPTY")
