"""`python -m canary baseline-server`: another checkout's server, started as the gate starts its own embedded one
(canary.targets.embedded_server: the pool, the engine threads, the CPUs), so that an A/B run compares builds and
nothing else. The real command as a process, with this checkout as the "other" tree: its server runs from that
tree with the gate's pool, stops with the command, and a server that dies ends the command with its log instead
of leaving it waiting; bad input is refused before anything starts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from canary.cli.baseline_server import interpreter
from canary.targets import alive, free_port
from runtime.config import DEFAULT_MODEL

ROOT = Path(__file__).resolve().parents[2]


def _start(tmp_path: Path, *args: str) -> tuple[subprocess.Popen, str]:
    """The command, and its first line once it has one (the server is healthy by then)."""
    proc = subprocess.Popen([sys.executable, "-m", "canary", "baseline-server", "--tree", str(ROOT),
                             "--log-dir", str(tmp_path), *args], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.wait(30)
        pytest.fail(f"baseline-server printed nothing (exit {proc.returncode}): {proc.stderr.read()[-2000:]}")
    return proc, line


def _server_pid(port: int) -> int:
    found = subprocess.run(["pgrep", "-f", f"runtime.serve --model {DEFAULT_MODEL} --port {port}"],
                           capture_output=True, text=True).stdout.split()
    assert len(found) == 1, found
    return int(found[0])


def test_the_baseline_runs_from_its_tree_with_the_gates_pool_and_stops_with_the_command(tmp_path):
    port = free_port()
    proc, line = _start(tmp_path, "--port", str(port))
    try:
        assert f"at http://127.0.0.1:{port}" in line and str(ROOT) in line
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        assert "dsv4_kv_pages_total 8192.0" in metrics  # the gate's pool, not runtime.serve's default
        pid = _server_pid(port)
        assert Path(f"/proc/{pid}/cwd").resolve() == ROOT  # the tree's runtime and model path
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        assert b"DSV4_NUM_THREADS=1" in env and b"--max-running\x00128" in Path(f"/proc/{pid}/cmdline").read_bytes()
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "baseline server stopped" in out
    deadline = time.monotonic() + 10
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(pid), "the server outlived the command"


def test_a_server_that_dies_ends_the_command_with_its_log(tmp_path):
    """Negative control of the wait: the server killed under it, the command exits 1 and shows the log's end."""
    port = free_port()
    proc, _ = _start(tmp_path, "--port", str(port))
    try:
        os.kill(_server_pid(port), signal.SIGKILL)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 1
    assert "the baseline server exited" in err


def test_a_server_that_never_starts_ends_the_command_with_its_log(tmp_path):
    """A runtime.serve argument the server refuses: it exits before /health answers."""
    done = subprocess.run([sys.executable, "-m", "canary", "baseline-server", "--tree", str(ROOT), "--log-dir",
                           str(tmp_path), "--", "--no-such-flag"], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    assert done.returncode == 1, done.stderr
    assert "the baseline server did not start" in done.stderr and "--no-such-flag" in done.stderr


@pytest.mark.parametrize("args, words", [
    (["--tree", "/"], "not a checkout of this project"),
    (["--tree", str(ROOT), "--model", "golden/models/no-such-model"], "not found in"),
    (["--tree", str(ROOT), "--server-cpus", "4-2"], "runs backwards"),
    (["--tree", str(ROOT), "--server-cpus", str(os.cpu_count() + 7)], "not among this process's CPUs"),
])
def test_bad_input_is_refused_before_anything_starts(args, words):
    done = subprocess.run([sys.executable, "-m", "canary", "baseline-server", *args], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert done.returncode == 2 and words in done.stderr, done.stderr


def test_the_trees_own_interpreter_is_taken_when_it_has_one(tmp_path):
    assert interpreter(tmp_path, None) == sys.executable
    assert interpreter(tmp_path, "/opt/py/bin/python") == "/opt/py/bin/python"
    own = tmp_path / ".venv" / "bin" / "python"
    own.parent.mkdir(parents=True)
    own.touch()
    assert interpreter(tmp_path, None) == str(own)
