"""A pytest run terminated (SIGTERM: `timeout`, a cancelled CI job, a device call's limit) unwinds like Ctrl-C
under the canary plugin, so the servers its fixtures and `with` blocks started are stopped, not left running in
their own process groups. A real pytest process with a fixture that starts a child in a session of its own, as
embedded_server does; the control is the same run without the plugin, where the child outlives pytest."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from canary.targets import alive

TEST_FILE = '''
import os, signal, subprocess, sys, time
from pathlib import Path

import pytest

HERE = Path(__file__).parent


@pytest.fixture
def server():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    (HERE / "child.pid").write_text(str(child.pid))
    try:
        yield child
    finally:
        os.killpg(child.pid, signal.SIGTERM)
        child.wait(10)
        (HERE / "torn_down").write_text("yes")


def test_waits(server):
    (HERE / "ready").write_text("yes")
    time.sleep(120)
'''


@pytest.mark.parametrize("plugin", [True, False], ids=["canary_plugin", "without_it"])
def test_sigterm_stops_what_the_run_started(tmp_path, plugin):
    (tmp_path / "test_waits.py").write_text(TEST_FILE)
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", str(tmp_path)]
    if not plugin:
        args[4:4] = ["-p", "no:canary.pytest_plugin"]
    run = subprocess.Popen(args, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    child = None
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "ready").exists():
            assert run.poll() is None and time.monotonic() < deadline, run.communicate()[0]
            time.sleep(0.05)
        child = int((tmp_path / "child.pid").read_text())
        run.send_signal(signal.SIGTERM)
        output = run.communicate(timeout=60)[0]
        if plugin:
            assert (tmp_path / "torn_down").exists(), output
            assert not alive(child), "the fixture's child outlived the run"
            assert "KeyboardInterrupt" in output and "stopping, servers first" in output
        else:  # the control: Python's default SIGTERM, no teardown, the child runs on
            assert run.returncode == -signal.SIGTERM
            assert not (tmp_path / "torn_down").exists() and alive(child)
    finally:
        run.kill()
        if child is not None and alive(child):
            os.killpg(child, signal.SIGKILL)
