"""Request limits of the real server, each answered with an OpenAI-shaped 4xx (or 429), never a
5xx: body size (Content-Length and chunked), prompt over the context, max_tokens over the
context, too many concurrent requests. Each limit is also shown not to fire just under it."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import ExitStack

import httpx
import pytest

from canary.targets import embedded_server
from runtime.env import Env

pytestmark = pytest.mark.e2e

KEY = "limits-key"
AUTH = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
BODY_LIMIT = 64 * 1024
CONTEXT = 256
SLOTS = 2
USER = [{"role": "user", "content": "hello"}]


def chat(root: str, **body) -> httpx.Response:
    return httpx.post(root + "/v1/chat/completions", headers=AUTH, timeout=60,
                      json={"model": "tiny-random", "messages": USER, **body})


def assert_error(resp: httpx.Response, status: int, code: str | None, param: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["code"] == code, error
    if param is not None:
        assert error["param"] == param, error
    return error


def gauge(root: str, name: str) -> float:
    text = httpx.get(root + "/metrics", headers=AUTH).text
    return float(next(line for line in text.splitlines() if line.startswith(name + " ")).split()[1])


def wait_gauge(root: str, name: str, value: float, timeout_s: float = 15.0) -> float:
    deadline = time.monotonic() + timeout_s
    while (seen := gauge(root, name)) != value and time.monotonic() < deadline:
        time.sleep(0.1)
    return seen


@pytest.fixture(scope="module")
def limits_server(tmp_path_factory):
    """Small limits so that crossing them is cheap: the body limit through its environment knob,
    the context through the CLI."""
    with embedded_server("tiny-random", ["--api-key", KEY, "--max-model-len", str(CONTEXT)],
                         max_running=None, num_pages=None, env={"DSV4_SERVER_MAX_BODY_BYTES": str(BODY_LIMIT)},
                         log_dir=tmp_path_factory.mktemp("limits")) as server:
        yield server.root_url


# ---- body size ----------------------------------------------------------------------------------
def padded_body(size: int) -> bytes:
    """A chat request of exactly `size` bytes (the padding is prompt text)."""
    skeleton = json.dumps({"model": "tiny-random", "max_tokens": 1, "messages": [{"role": "user", "content": ""}]})
    return skeleton.replace('"content": ""', '"content": "' + "x" * (size - len(skeleton)) + '"').encode()


def chunked(body: bytes, chunk: int = 8192):
    for start in range(0, len(body), chunk):
        yield body[start:start + chunk]


def test_body_over_the_limit_is_413(limits_server):
    resp = httpx.post(limits_server + "/v1/chat/completions", headers=AUTH, content=padded_body(BODY_LIMIT + 1))
    assert "exceeds" in assert_error(resp, 413, "request_too_large")["message"]


def test_body_at_the_limit_passes_the_size_check(limits_server):
    resp = httpx.post(limits_server + "/v1/chat/completions", headers=AUTH, content=padded_body(BODY_LIMIT))
    assert_error(resp, 400, "context_length_exceeded")  # read whole, then refused for its prompt


def test_chunked_body_over_the_limit_is_413(limits_server):
    # No Content-Length to check up front: the limit must be counted while the body streams in.
    resp = httpx.post(limits_server + "/v1/chat/completions", headers=AUTH,
                      content=chunked(padded_body(2 * BODY_LIMIT)))
    assert "content-length" not in resp.request.headers and resp.request.headers["transfer-encoding"] == "chunked"
    assert_error(resp, 413, "request_too_large")


def test_chunked_body_under_the_limit_is_served(limits_server):
    resp = httpx.post(limits_server + "/v1/chat/completions", headers=AUTH, content=chunked(padded_body(200)))
    assert resp.request.headers["transfer-encoding"] == "chunked"
    assert resp.status_code == 200, resp.text


# ---- context: prompt and max_tokens -------------------------------------------------------------
def test_prompt_over_the_context_is_400(limits_server):
    resp = chat(limits_server, messages=[{"role": "user", "content": "y" * (2 * CONTEXT)}], max_tokens=1)
    assert "context" in assert_error(resp, 400, "context_length_exceeded", "messages")["message"]


def test_max_tokens_is_bounded_by_the_context_to_the_token(limits_server):
    prompt_tokens = chat(limits_server, max_tokens=1).json()["usage"]["prompt_tokens"]
    room = CONTEXT - prompt_tokens
    assert chat(limits_server, max_tokens=room, temperature=0).status_code == 200
    assert_error(chat(limits_server, max_tokens=room + 1), 400, "context_length_exceeded", "max_tokens")
    assert_error(chat(limits_server, max_completion_tokens=room + 1), 400, "context_length_exceeded", "max_tokens")
    assert_error(chat(limits_server, max_tokens=10**18), 400, "context_length_exceeded", "max_tokens")
    assert_error(chat(limits_server, max_tokens=0), 400, None, "max_tokens")


# ---- concurrent requests ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def slots_server(tmp_path_factory):
    """Two generation slots, and slow steps so that two long streams really hold them."""
    with embedded_server("tiny-random", ["--api-key", KEY, "--max-concurrent-requests", str(SLOTS)],
                         faults=["slow-step"], max_running=None, num_pages=None,
                         env={"DSV4_SLOW_STEP_MS": "50"}, log_dir=tmp_path_factory.mktemp("slots")) as server:
        yield server.root_url


def open_stream(stack: ExitStack, client: httpx.Client, root: str) -> Iterator[str]:
    """Start a long stream and read its first event, so the request is surely in flight. The caller
    keeps the returned iterator: dropping a half-read one closes its connection."""
    resp = stack.enter_context(client.stream(
        "POST", root + "/v1/chat/completions", headers=AUTH,
        json={"model": "tiny-random", "messages": USER, "max_tokens": 2000, "stream": True}))
    assert resp.status_code == 200
    lines = resp.iter_lines()
    assert next(lines).startswith("data: ")
    return lines


def test_one_request_over_the_concurrency_limit_is_429_with_retry_after(slots_server):
    with httpx.Client(timeout=60) as client, ExitStack() as streams:
        held = [open_stream(streams, client, slots_server) for _ in range(SLOTS)]
        assert gauge(slots_server, "dsv4_http_requests_in_flight") == SLOTS
        refused = chat(slots_server, max_tokens=1)
        assert_error(refused, 429, "too_many_requests")
        assert refused.json()["error"]["type"] == "rate_limit_error"
        assert int(refused.headers["Retry-After"]) >= 1
        # Only generation holds slots: the rest of the API still answers.
        assert httpx.get(slots_server + "/v1/models", headers=AUTH).status_code == 200
        assert all(next(line for line in lines if line).startswith("data: ") for lines in held)  # still streaming
    # The clients hung up mid-stream: both slots come back, and so do the KV pages.
    assert wait_gauge(slots_server, "dsv4_http_requests_in_flight", 0) == 0
    assert wait_gauge(slots_server, "dsv4_kv_pages_in_use", 0) == 0
    assert chat(slots_server, max_tokens=1).status_code == 200


def test_refused_requests_do_not_keep_slots(slots_server):
    for _ in range(3 * SLOTS):
        assert chat(slots_server, max_tokens=-1).status_code == 400
        assert httpx.post(slots_server + "/v1/chat/completions", content=b"{").status_code == 401
    assert gauge(slots_server, "dsv4_http_requests_in_flight") == 0
    assert chat(slots_server, max_tokens=1).status_code == 200


def test_default_concurrency_limit_leaves_room_for_the_canary_gate():
    gate_sessions = 80  # `make gate`: pytest -m stress --sessions 80, all in flight at once
    assert Env().server_max_concurrent >= 2 * gate_sessions
    assert Env.load({"DSV4_SERVER_MAX_CONCURRENT": "7"}).server_max_concurrent == 7
