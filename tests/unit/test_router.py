"""The PD router's chat path against mock upstreams (runtime/router.py): the prompt's call leaves
first, and a traced request's marks are read back from the router and both upstreams in one GET."""

from __future__ import annotations

import json

import httpx
import pytest
from fastapi.testclient import TestClient

from runtime.router import create_router_app
from runtime.server.trace import TRACE_HEADER

pytestmark = pytest.mark.unit
BODY = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
SSE = b'data: {"choices": [{"index": 0, "delta": {"content": "x"}}]}\n\ndata: [DONE]\n\n'


def mock_upstreams(monkeypatch, seen: list[tuple[str, str, str | None]]) -> None:
    """Upstreams `prefill` and `decode` that log (host, path, trace header) as each request reaches them."""
    real = httpx.AsyncClient

    def answer(request: httpx.Request) -> httpx.Response:
        role = request.url.host
        seen.append((role, request.url.path, request.headers.get(TRACE_HEADER)))
        if request.url.path.startswith("/debug/trace/"):
            return httpx.Response(200, json={"marks": {"received": 1.0 if role == "prefill" else 2.0}})
        if role == "prefill":
            return httpx.Response(200, json={"prefilled": True})
        return httpx.Response(200, stream=httpx.ByteStream(SSE), headers={"content-type": "text/event-stream"})

    transport = httpx.MockTransport(answer)
    monkeypatch.setattr(httpx, "AsyncClient", lambda **kw: real(transport=transport, **kw))


def test_the_prefill_call_leaves_before_the_decode_call(monkeypatch):
    """The prompt is the critical path; the decode side only opens the room meanwhile. The router
    awaited its decode call inline and made the prefill call a task, so the decode call ran first."""
    seen: list[tuple[str, str, str | None]] = []
    mock_upstreams(monkeypatch, seen)
    with TestClient(create_router_app(["http://prefill:1"], ["http://decode:2"])) as router:
        for _ in range(3):
            reply = router.post("/v1/chat/completions", content=json.dumps(BODY))
            assert reply.status_code == 200 and reply.content == SSE
    assert [role for role, _, _ in seen] == ["prefill", "decode"] * 3


def test_a_traced_request_is_read_back_from_the_router_and_both_upstreams(monkeypatch):
    seen: list[tuple[str, str, str | None]] = []
    mock_upstreams(monkeypatch, seen)
    with TestClient(create_router_app(["http://prefill:1"], ["http://decode:2"])) as router:
        reply = router.post("/v1/chat/completions", content=json.dumps(BODY), headers={TRACE_HEADER: "k1"})
        assert reply.status_code == 200
        assert {(role, header) for role, _, header in seen} == {("prefill", "k1"), ("decode", "k1")}
        found = router.get("/debug/trace/k1").json()
        assert found["prefill"] == {"received": 1.0} and found["decode"] == {"received": 2.0}
        marks = found["router"]
        assert marks["received"] <= marks["decode_headers"] <= marks["first_token_relayed"]
        router.post("/v1/chat/completions", content=json.dumps(BODY))  # untraced: no header goes upstream
        assert [header for _, _, header in seen[-2:]] == [None, None]
