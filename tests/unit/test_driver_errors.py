"""A server error ends one session as a named failure; the run goes on (it must not crash the gate
before the other sessions and oracles are counted). The server is an httpx MockTransport."""

from __future__ import annotations

import httpx
import openai
import pytest

from canary.driver import DriverOptions, SessionDriver
from canary.targets import Target

pytestmark = pytest.mark.unit


def test_http_500_and_dropped_connections_become_failures(monkeypatch):
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        if len(calls) % 2:
            return httpx.Response(500, json={"error": {"message": "internal error: NaN", "type": "server_error"}})
        raise httpx.ConnectError("connection reset")

    real = openai.AsyncOpenAI

    def client(**kwargs):
        kwargs["http_client"] = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        return real(**kwargs)

    monkeypatch.setattr(openai, "AsyncOpenAI", client)
    target = Target("mock", "http://mock.invalid/v1", "m", False)
    result = SessionDriver(target, DriverOptions(sessions=4, stream_ratio=0.0)).run()
    oracles = sorted(f.oracle for _, f in result.failures)
    assert len(calls) == 4, "one request per session, then the session ends"
    assert oracles == ["http-status", "http-status", "transport", "transport"]
    assert result.sessions_completed == 0


def test_the_embedded_target_sends_the_key_given_to_the_server():
    from canary.targets import api_key_in

    assert api_key_in(["--dtype=float32", "--api-key=s3cret"]) == "s3cret"
    assert api_key_in(["--api-key", "k2", "--tp", "2"]) == "k2"
    assert api_key_in(["--dtype", "float32"]) is None
