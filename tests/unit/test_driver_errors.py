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


def test_every_session_ends_once_with_its_reason_and_the_gate_checks_it(monkeypatch):
    """Each session's end is recorded (failed with the failure that ended it); the gate's account
    fails a session that ended twice, never, or failed with no failure on the record (a finding
    computed and dropped, as stream-equivalence's were)."""
    from canary.driver import RunResult
    from canary.gate import GateOutcome, check_session_ends
    from canary.oracles.turn import Failure

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(500, json={"error": {"message": "boom", "type": "server_error"}})

    real = openai.AsyncOpenAI
    monkeypatch.setattr(openai, "AsyncOpenAI", lambda **kw: real(**{
        **kw, "http_client": httpx.AsyncClient(transport=httpx.MockTransport(handler))}))
    result = SessionDriver(Target("mock", "http://mock.invalid/v1", "m", False),
                           DriverOptions(sessions=3, stream_ratio=0.0)).run()
    assert sorted((s, status) for s, status, _ in result.session_ends) == [(0, "failed"), (1, "failed"),
                                                                           (2, "failed")]
    assert all("[http-status]" in reason for _, _, reason in result.session_ends)
    outcome = GateOutcome()
    check_session_ends(result, outcome)
    assert outcome.passed and outcome.summary["sessions_failed"] == 3

    opts = DriverOptions(sessions=3)
    planted = RunResult(opts, "t", 0.0, 1.0, session_ends=[(0, "completed", ""), (0, "completed", ""),
                                                           (1, "failed", "[x] dropped")])
    outcome = GateOutcome()
    check_session_ends(planted, outcome)
    text = "\n".join(outcome.failures)
    assert "session 0 ended 2 times" in text and "session 2 ended 0 times" in text
    assert "session 1 ended failed" in text and "no failure of it reached the verdict" in text
    planted.failures.append((0.5, Failure("x", 1, 2, "dropped", "")))
    planted.session_ends[1:] = [(2, "completed", "")]
    planted.session_ends[0] = (0, "completed", "")
    planted.session_ends.append((1, "failed", "[x] dropped"))
    outcome = GateOutcome()
    check_session_ends(planted, outcome)
    assert outcome.passed, outcome.failures


@pytest.mark.parametrize("body, done, after", [
    (b'data: {"a": 1}\n\ndata: [DONE]\n\n', True, 0),
    (b'data: {"a": 1}\n\n', False, 0),
    (b'data: {"a": 1}\n\ndata: [DONE]\n\ndata: {"b": 2}\n\n', True, 1),
    (b'data: {"a": 1}\n\ndata: [DO', False, 0),
])
def test_the_sse_probe_sees_the_done_terminator_the_client_hides(body, done, after):
    """The transport probe passes the bytes unchanged (in any chunking) and notes [DONE]."""
    import asyncio

    from canary.driver import SSE_PROBE, _openai_httpx, _sse_probe_transport

    hx = _openai_httpx()

    class Chunked(hx.AsyncByteStream):
        async def __aiter__(self):
            for i in range(0, len(body), 7):  # lines split across chunks
                yield body[i:i + 7]

    def handler(request):
        return hx.Response(200, headers={"content-type": "text/event-stream"}, stream=Chunked())

    async def read():
        async with hx.AsyncClient(transport=_sse_probe_transport(hx)(hx.MockTransport(handler))) as client:
            async with client.stream("POST", "http://mock.invalid/v1/chat/completions") as response:
                data = await response.aread()
                return data, response.extensions[SSE_PROBE]

    data, probe = asyncio.run(read())
    assert data == body
    assert (probe.done, probe.events_after_done) == (done, after)
