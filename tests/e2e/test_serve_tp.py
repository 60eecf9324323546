"""`runtime.serve --tp 2 --overlap`: answers like --tp 1 and leaves no process behind on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from canary.oracles.logprob_close import Generation, check_logprobs_close
from canary.targets import alive, embedded_server

pytestmark = pytest.mark.e2e
BODY = {"model": "tiny-random", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 12,
        "temperature": 0, "logprobs": True, "top_logprobs": 5}


def serve(tmp_path: Path, *extra: str):
    return embedded_server("tiny-random", extra, max_running=None, num_pages=None, log_dir=tmp_path)


def children_of(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-s", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split() if int(p) != pid]


def test_tp2_overlap_server_matches_tp1_and_exits_cleanly(tmp_path):
    with serve(tmp_path) as single:
        one = httpx.post(single.url_for("v1/chat/completions"), json=BODY, timeout=60).json()
    with serve(tmp_path, "--tp", "2", "--overlap") as tp:
        assert len(children_of(tp.pid)) >= 1, "--tp 2 must start a worker process"
        two = httpx.post(tp.url_for("v1/chat/completions"), json=BODY, timeout=60).json()
        os.kill(tp.pid, signal.SIGTERM)  # the server alone, as a deployment stops it: it must stop its workers
        assert wait_exited(tp.pid), "the server did not exit on SIGTERM"
        leftovers = wait_until_gone(tp.pid)
    # TP=2 sums partial products in another order: exact tokens, except at a recorded near-tie.
    check_logprobs_close([generation(one)], [generation(two)], margin=0.05, logprob_atol=1e-3)
    assert leftovers == [], "worker processes outlived the server"


def wait_exited(pid: int, timeout_s: float = 30.0) -> bool:
    """True once `pid` is a zombie or gone (the launcher reaps it when its block ends)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.2)
    return False


def wait_until_gone(session: int, timeout_s: float = 15.0) -> list[str]:
    """Processes of the server's session still alive after `timeout_s` (their command lines)."""
    deadline = time.monotonic() + timeout_s
    while children_of(session) and time.monotonic() < deadline:
        time.sleep(0.2)
    return [Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ") for pid in children_of(session)
            if Path(f"/proc/{pid}/cmdline").exists()]


def generation(response: dict) -> Generation:
    content = response["choices"][0]["logprobs"]["content"]
    return Generation([t["token"] for t in content], [t["logprob"] for t in content],
                      [[(alt["token"], alt["logprob"]) for alt in t["top_logprobs"]] for t in content])
