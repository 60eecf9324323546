"""The PD router's chat path against in-memory upstreams (runtime/router.py, tests/fake_upstreams.py):
the prompt's call leaves first, whole; a quiet router reuses its connections and a client that hangs up
closes the decode call's; a traced request's marks are read back from the router and both upstreams
in one GET; requests a server took nothing of go to the next one."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from urllib.parse import urlsplit

import httpx
import pytest
from fastapi.testclient import TestClient

from runtime.disagg.protocol import BOOTSTRAP_HEADER, ROOM_HEADER
from runtime.router import MAX_PREFILL_TRIES, create_router_app
from runtime.server.trace import TRACE_HEADER
from tests.fake_upstreams import SSE_TYPE, FakeReply, FakeRequest, FakeUpstreams

pytestmark = pytest.mark.unit
BODY = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
SSE = b'data: {"choices": [{"index": 0, "delta": {"content": "x"}}]}\n\ndata: [DONE]\n\n'


def sse_reply() -> FakeReply:
    return FakeReply(chunks=[SSE[:40], SSE[40:]], content_type=SSE_TYPE)


def pair(answer=None) -> tuple[FakeUpstreams, object]:
    """Upstreams `prefill` and `decode` (by default: the prompt's call answered {}, the decode call an SSE
    stream) and a router over them that polls no health."""

    def default(request: FakeRequest) -> FakeReply:
        return FakeReply.json(200, {}) if request.host == "prefill" else sse_reply()

    fake = FakeUpstreams(answer or default)
    return fake, create_router_app(["http://prefill:1"], ["http://decode:2"], health_every_s=None,
                                   connect=fake.connect)


def test_the_prefill_call_leaves_whole_before_the_decode_call():
    """The prompt is the critical path; the decode side only opens the room meanwhile. The router once
    awaited its decode call inline and made the prefill call a task, so the decode call ran first; and
    httpx wrote a request's head and body in two writes, so the decode call's head could go out between
    the prompt's (the prefill handler then waited for its body). The fake logs a request once read whole."""
    fake, app = pair()
    with TestClient(app) as router:
        for _ in range(3):
            reply = router.post("/v1/chat/completions", content=json.dumps(BODY))
            assert reply.status_code == 200 and reply.content == SSE
    assert fake.hosts() == ["prefill", "decode"] * 3
    rooms = [request.headers[ROOM_HEADER] for request in fake.requests]
    assert rooms[0::2] == rooms[1::2] and len(set(rooms)) == 3  # one fresh room per request, on both calls
    assert all(request.body == json.dumps(BODY).encode() for request in fake.requests)


def test_more_requests_than_a_default_connection_pool_all_finish():
    """Each request holds two upstream connections, and its prefill call's until its decode call
    arrives: with httpx's default cap of 100 connections, 100 prefill calls (which leave before their
    decode calls) held them all while their decode calls waited for one - a wedge until the PD deadline.
    The fake behaves like a PD pair: the prompt's call is answered only once its room's decode call came."""
    rooms: dict[str, asyncio.Event] = {}

    async def answer(request: FakeRequest) -> FakeReply:
        room = rooms.setdefault(request.headers[ROOM_HEADER], asyncio.Event())
        if request.host == "decode":
            room.set()
            return sse_reply()
        await room.wait()
        return FakeReply.json(200, {})

    fake, app = pair(answer)

    async def run() -> list[int]:
        async with app.router.lifespan_context(app), httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                                                       base_url="http://router") as client:
            replies = asyncio.gather(*(client.post("/v1/chat/completions", content=json.dumps(BODY))
                                       for _ in range(130)))
            return [reply.status_code for reply in await asyncio.wait_for(replies, 20)]

    assert asyncio.run(run()) == [200] * 130
    assert fake.connections >= 130  # a burst this size holds many connections at once


def test_a_quiet_router_reuses_its_connections_and_a_hang_up_closes_the_decode_call_only():
    """One request at a time, streamed or not, goes over the same two kept-alive connections (a new one
    costs its connect on the TTFT path). A client that hangs up mid-stream closes its decode call's
    connection, which the decode server reads as the request aborted, and that connection is not reused.
    The prompt's call is left to end on its own (the prefill side finishes the room it is writing): the
    first lean router cancelled it with the client's stream, so the prefill side failed rooms mid-write
    (caught by test_pd_shutdown's digest-computing case under load)."""
    release = threading.Event()  # the slow request's prompt call is answered once set

    async def slow_stream():
        yield SSE[:40]
        for _ in range(500):  # until the router hangs up
            await asyncio.sleep(0.01)
            yield b": still here\n\n"

    async def answer(request: FakeRequest) -> FakeReply:
        slow = json.loads(request.body).get("slow")
        if request.host == "prefill":
            while slow and not release.is_set():
                await asyncio.sleep(0.01)
            return FakeReply.json(200, {})
        return FakeReply(chunks=slow_stream(), content_type=SSE_TYPE) if slow else sse_reply()

    fake, app = pair(answer)
    with TestClient(app) as router:
        for stream in (True, False, True, False, True):
            reply = router.post("/v1/chat/completions", content=json.dumps({**BODY, "stream": stream}))
            assert reply.status_code == 200
        assert (fake.connections, fake.closed) == (2, 0)
        with router.stream("POST", "/v1/chat/completions", content=json.dumps({**BODY, "slow": True})) as reply:
            next(reply.iter_bytes())  # hang up after the first bytes
        deadline = time.monotonic() + 5  # the router's loop runs in the client's portal thread meanwhile
        while not fake.closed and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)
        assert fake.closed == 1  # the decode call's; the prompt's call still waits for its answer
        release.set()
        time.sleep(0.2)  # the prompt's call is answered and its connection goes back idle
        assert router.post("/v1/chat/completions", content=json.dumps(BODY)).status_code == 200
        assert fake.connections == 3  # the prompt call's connection, answered, was reused; the decode one not
        assert fake.closed == 1


def test_a_traced_request_is_read_back_from_the_router_and_both_upstreams():
    def answer(request: FakeRequest) -> FakeReply:
        if request.path.startswith("/debug/trace/"):
            return FakeReply.json(200, {"marks": {"received": 1.0 if request.host == "prefill" else 2.0}})
        return FakeReply.json(200, {}) if request.host == "prefill" else sse_reply()

    fake, app = pair(answer)
    with TestClient(app) as router:
        reply = router.post("/v1/chat/completions", content=json.dumps(BODY), headers={TRACE_HEADER: "k1"})
        assert reply.status_code == 200
        assert {(r.host, r.headers.get(TRACE_HEADER)) for r in fake.requests} == {("prefill", "k1"), ("decode", "k1")}
        found = router.get("/debug/trace/k1").json()
        assert found["prefill"] == {"received": 1.0} and found["decode"] == {"received": 2.0}
        marks = found["router"]
        assert marks["received"] <= marks["prefill_sent"] <= marks["decode_headers"] <= marks["first_token_relayed"]
        router.post("/v1/chat/completions", content=json.dumps(BODY))  # untraced: no header goes upstream
        assert [r.headers.get(TRACE_HEADER) for r in fake.requests[-2:]] == [None, None]


def error_body(code: str) -> dict:
    return {"error": {"message": "planted", "type": "server_error", "code": code}}


def error_event(code: str) -> bytes:
    """A decode server's stream that opened, then failed before its first token (runtime/server/app.py)."""
    return b"data: " + json.dumps(error_body(code)).encode() + b"\n\ndata: [DONE]\n\n"


def pd_fleet(prefill_state: dict[str, str], decode_error: dict[str, tuple[int, str]] | None = None,
             decode_state: dict[str, str] | None = None, stream_error: dict[str, str] | None = None):
    """In-memory upstreams: prefill servers by host, each "ok", "stopping" (its 503, and the decode side's
    report of it) or "down" (nothing listens); decode servers by host (`decode_state`, default one "ok"
    server), "down" or streaming SSE unless the prefill server named in the request's bootstrap header
    is not ok (or `decode_error` names an error status for that server, or `stream_error` an error code
    the decode side's open stream ends with, before any token). Returns (the router app, the fake)."""

    def error(status: int, code: str) -> FakeReply:
        return FakeReply.json(status, error_body(code))

    def answer(request: FakeRequest) -> FakeReply:
        bootstrap = bootstrap_host(request)
        state = prefill_state.get(bootstrap, "ok")
        if request.host in prefill_state:  # the prompt's call
            return error(503, "pd_prefill_stopping") if state == "stopping" else FakeReply.json(200, {})
        if (decode_error or {}).get(bootstrap):  # a decode server's answer from here on
            return error(*(decode_error or {})[bootstrap])
        if (stream_error or {}).get(bootstrap):
            event = error_event((stream_error or {})[bootstrap])
            return FakeReply(chunks=[event[:30], event[30:]], content_type=SSE_TYPE)
        if state == "stopping":
            return error(503, "pd_prefill_stopping")
        if state == "down":
            return error(502, "pd_prefill_unreachable")
        return sse_reply()

    down = {host for host, state in {**prefill_state, **(decode_state or {})}.items() if state == "down"}
    fake = FakeUpstreams(answer, down=down)
    app = create_router_app([f"http://{host}:1" for host in prefill_state],
                            [f"http://{host}:2" for host in decode_state or {"decode": "ok"}],
                            health_every_s=None, connect=fake.connect)  # the request path's retries alone
    return app, fake


def bootstrap_host(request: FakeRequest) -> str:
    """The host of the prefill server a request names in its bootstrap header."""
    return urlsplit(request.headers[BOOTSTRAP_HEADER.lower()]).hostname or ""


def decode_calls(fake: FakeUpstreams) -> list[str]:
    """The bootstrap (prefill) host of each decode call, in order."""
    return [bootstrap_host(r) for r in fake.requests if r.host.startswith("decode")]


def test_a_request_a_stopping_prefill_server_refuses_goes_to_the_next_one():
    """A prefill server shutting down (503 pd_prefill_stopping, which the decode side reports) took nothing
    of the request and the client has had nothing: the router offers it to the next prefill server, and
    passes the first over for the next requests (UPSTREAM_REST_S). Every request is served. Negative
    control: the old router answered the error to every request it sent there."""
    app, fake = pd_fleet({"prefill-a": "stopping", "prefill-b": "ok"})
    with TestClient(app) as router:
        replies = [router.post("/v1/chat/completions", content=json.dumps(BODY)) for _ in range(4)]
    assert [(r.status_code, r.content) for r in replies] == [(200, SSE)] * 4
    assert decode_calls(fake) == ["prefill-a", "prefill-b", "prefill-b", "prefill-b", "prefill-b"]


def test_a_prefill_server_nothing_listens_on_is_passed_over_before_any_decode_call():
    """A prefill server that refuses the connection received nothing: the router offers the request to the
    next one at once, and no decode server opens a room for the down one (the router before the lean
    client made that decode call, and learned of the refusal only from the decode side's 502)."""
    app, fake = pd_fleet({"prefill-a": "down", "prefill-b": "ok"})
    with TestClient(app) as router:
        replies = [router.post("/v1/chat/completions", content=json.dumps(BODY)) for _ in range(4)]
    assert [(r.status_code, r.content) for r in replies] == [(200, SSE)] * 4
    assert fake.refused == ["prefill-a"] and decode_calls(fake) == ["prefill-b"] * 4


def test_with_every_prefill_server_down_the_client_gets_an_error_naming_one():
    app, fake = pd_fleet({"prefill-a": "down", "prefill-b": "down"})
    with TestClient(app) as router:
        reply = router.post("/v1/chat/completions", content=json.dumps(BODY))
    error = reply.json()["error"]
    assert (reply.status_code, error["code"]) == (502, "pd_upstream_unreachable")
    assert "prefill server http://prefill-" in error["message"] and "cannot connect" in error["message"]
    assert sorted(fake.refused) == ["prefill-a", "prefill-b"] and not fake.requests


def test_a_prefill_server_the_decode_side_cannot_reach_is_passed_over():
    """A rolling restart's race (CI, 2026-12-05): the prompt went over a kept-alive connection to a
    prefill server whose listening socket then closed, so the decode side's room call could not connect
    and it answered 502 pd_prefill_unreachable. No room opened, no KV landed, the client has had
    nothing: the router offers the request to the next prefill server. Negative control: the router
    before this answered the 502 to the client."""
    app, fake = pd_fleet({"prefill-a": "ok", "prefill-b": "ok"},
                         decode_error={"prefill-a": (502, "pd_prefill_unreachable")})
    with TestClient(app) as router:
        replies = [router.post("/v1/chat/completions", content=json.dumps(BODY)) for _ in range(3)]
    assert [(r.status_code, r.content) for r in replies] == [(200, SSE)] * 3
    assert decode_calls(fake) == ["prefill-a", "prefill-b", "prefill-b", "prefill-b"]


def test_a_failure_after_the_prefill_server_took_the_request_is_not_retried():
    """A KV that arrived corrupt (or any error but the two above) may come after the prefill server
    computed the prompt: the router answers it as it is and offers the request to no one else."""
    app, fake = pd_fleet({"prefill-a": "ok", "prefill-b": "ok"}, decode_error={"prefill-a": (502, "pd_kv_corrupt")})
    with TestClient(app) as router:
        first = router.post("/v1/chat/completions", content=json.dumps(BODY))
    assert (first.status_code, first.json()["error"]["code"]) == (502, "pd_kv_corrupt")
    assert fake.hosts() == ["prefill-a", "decode"] and decode_calls(fake) == ["prefill-a"]


def test_with_every_prefill_server_stopping_the_client_gets_the_error():
    app, fake = pd_fleet({"prefill-a": "stopping", "prefill-b": "stopping"})
    with TestClient(app) as router:
        reply = router.post("/v1/chat/completions", content=json.dumps(BODY))
    assert (reply.status_code, reply.json()["error"]["code"]) == (503, "pd_prefill_stopping")
    assert sorted(decode_calls(fake)) == ["prefill-a", "prefill-b"]


def test_a_decode_server_nothing_listens_on_hands_the_room_to_the_next_one():
    """The first decode server is down: the request's room goes to the next decode server, and the
    prompt's call stands (no prompt computed twice); the down server is passed over for the next
    requests. Negative control: the old router answered 502 pd_upstream_unreachable to every request
    it sent there."""
    app, fake = pd_fleet({"prefill": "ok"}, decode_state={"decode-a": "down", "decode-b": "ok"})
    with TestClient(app) as router:
        replies = [router.post("/v1/chat/completions", content=json.dumps(BODY)) for _ in range(3)]
    assert [(r.status_code, r.content) for r in replies] == [(200, SSE)] * 3
    assert fake.refused == ["decode-a"]
    assert fake.hosts() == ["prefill", "decode-b"] * 3
    rooms = [r.headers[ROOM_HEADER] for r in fake.requests]
    assert rooms[0] == rooms[1]  # the room the prompt's call stands for went to decode-b


def test_a_prompt_call_that_breaks_as_it_is_written_is_an_error_and_not_offered_again():
    """The prefill server may have read part of it: the client gets the router's 502 naming the prefill
    server, no decode server opens a room, and no other prefill server gets it (it may be computing)."""
    app, fake = pd_fleet({"prefill-a": "ok", "prefill-b": "ok"})

    async def breaking(host: str, port: int):
        reader, writer = await fake.connect(host, port)

        async def broken_drain() -> None:
            raise BrokenPipeError(32, "Broken pipe")

        if host == "prefill-a":
            writer.drain = broken_drain  # type: ignore[method-assign]
        return reader, writer

    app = create_router_app(["http://prefill-a:1", "http://prefill-b:1"], ["http://decode:2"],
                            health_every_s=None, connect=breaking)
    with TestClient(app) as router:
        reply = router.post("/v1/chat/completions", content=json.dumps(BODY))
    error = reply.json()["error"]
    assert (reply.status_code, error["code"]) == (502, "pd_upstream_unreachable")
    assert "prefill server http://prefill-a:1" in error["message"]
    assert "connection broke: BrokenPipeError" in error["message"]
    assert decode_calls(fake) == [] and fake.hosts() == ["prefill-a"]


@pytest.mark.parametrize("code", ["pd_prefill_stopping", "pd_prefill_unreachable"])
def test_a_stream_whose_first_event_is_a_prefill_refusal_goes_on_through_the_next_prefill_server(code):
    """The decode side opens a stream as the room opens (headers only: it holds every byte for the first
    token), and the router opens the client's then. A prefill server that took nothing of the request
    after the room opened (a drain failing its open rooms; its answer broken off before its first line)
    makes that stream's first event the refusal: the router offers the request to the next prefill
    server, and the client's stream carries that one's answer alone. Negative control: a router that
    passed open streams through as they came sends the client the refusal."""
    app, fake = pd_fleet({"prefill-a": "ok", "prefill-b": "ok"}, stream_error={"prefill-a": code})
    with TestClient(app) as router:
        replies = [router.post("/v1/chat/completions", content=json.dumps(BODY)) for _ in range(3)]
    assert [(r.status_code, r.content) for r in replies] == [(200, SSE)] * 3
    assert decode_calls(fake) == ["prefill-a", "prefill-b", "prefill-b", "prefill-b"]  # a rested after its refusal


def test_an_open_streams_other_errors_reach_the_client_inside_it_and_are_not_retried():
    """Any other error before the first token (a timeout, the prefill side's own failure) may come after
    the prefill server computed the prompt: the client gets it as its stream's event, once."""
    app, fake = pd_fleet({"prefill-a": "ok", "prefill-b": "ok"}, stream_error={"prefill-a": "pd_timeout"})
    with TestClient(app) as router:
        reply = router.post("/v1/chat/completions", content=json.dumps(BODY))
    assert (reply.status_code, reply.content) == (200, error_event("pd_timeout"))
    assert decode_calls(fake) == ["prefill-a"]


def test_a_stream_refused_by_every_prefill_server_ends_with_the_last_refusal_inside_it():
    """Each prefill server refuses inside the stream: MAX_PREFILL_TRIES servers are offered the request
    (never more), and the client's stream ends with the last refusal."""
    hosts = [f"prefill-{i}" for i in range(4)]
    app, fake = pd_fleet(dict.fromkeys(hosts, "ok"), stream_error=dict.fromkeys(hosts, "pd_prefill_stopping"))
    with TestClient(app) as router:
        reply = router.post("/v1/chat/completions", content=json.dumps(BODY))
    assert (reply.status_code, reply.content) == (200, error_event("pd_prefill_stopping"))
    assert decode_calls(fake) == hosts[:MAX_PREFILL_TRIES]


def test_a_retry_inside_an_open_stream_that_fails_with_a_status_ends_the_stream_with_that_error():
    """The next prefill server's pair answers an error status (its decode side failed before opening a
    room): the client's stream is open already, so the error is its last event, OpenAI-shaped."""
    app, fake = pd_fleet({"prefill-a": "ok", "prefill-b": "ok"}, stream_error={"prefill-a": "pd_prefill_stopping"},
                         decode_error={"prefill-b": (503, "pd_out_of_pages")})
    with TestClient(app) as router:
        reply = router.post("/v1/chat/completions", content=json.dumps(BODY))
    assert (reply.status_code, reply.content) == (200, error_event("pd_out_of_pages"))
    assert decode_calls(fake) == ["prefill-a", "prefill-b"]
