"""`runtime.serve --tp 2 --overlap`: answers like --tp 1 and leaves no process behind on SIGTERM."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from canary.targets import free_port, wait_healthy
from runtime.distributed.logprob_check import Generation, check_logprobs_close

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
BODY = {"model": "tiny-random", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 12,
        "temperature": 0, "logprobs": True, "top_logprobs": 5}


def serve(tmp_path: Path, *extra: str):
    port = free_port()
    log = (tmp_path / f"serve-{port}.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "runtime.serve", "--model", "tiny-random", "--port", str(port),
                             *extra], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    wait_healthy(f"http://127.0.0.1:{port}", proc, 120, tmp_path / f"serve-{port}.log")
    return proc, f"http://127.0.0.1:{port}"


def children_of(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-s", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split() if int(p) != pid]


def test_tp2_overlap_server_matches_tp1_and_exits_cleanly(tmp_path):
    single, url1 = serve(tmp_path)
    try:
        one = httpx.post(url1 + "/v1/chat/completions", json=BODY, timeout=60).json()
    finally:
        single.send_signal(signal.SIGTERM)
        single.wait(timeout=30)
    tp, url2 = serve(tmp_path, "--tp", "2", "--overlap")
    try:
        assert len(children_of(tp.pid)) >= 1, "--tp 2 must start a worker process"
        two = httpx.post(url2 + "/v1/chat/completions", json=BODY, timeout=60).json()
    finally:
        tp.send_signal(signal.SIGTERM)
        tp.wait(timeout=30)
    # TP=2 sums partial products in another order: exact tokens, except at a recorded near-tie.
    check_logprobs_close([generation(one)], [generation(two)], margin=0.05, logprob_atol=1e-3)
    assert wait_until_gone(tp.pid) == [], "worker processes outlived the server"


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
