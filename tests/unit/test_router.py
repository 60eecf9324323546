"""The PD router's chat path against mock upstreams (runtime/router.py): the prompt's call leaves
first, whole, and a traced request's marks are read back from the router and both upstreams in one GET."""

from __future__ import annotations

import asyncio
import json

import httpcore
import httpx
import pytest
from fastapi.testclient import TestClient

from runtime.disagg.protocol import ROOM_HEADER
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
        if request.url.path == "/health":  # the router's background polls (tested on their own below)
            return httpx.Response(200, json={"status": "ok"})
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


class RecordingBackend(httpcore.AsyncNetworkBackend):
    """Connections that log each write as (host, what) - what is "headers" or "body" - and answer each
    request with a canned 200: the order in which the router's requests reach the wire."""

    def __init__(self) -> None:
        self.writes: list[tuple[str, str]] = []

    async def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
        return RecordingStream(host, self.writes)


class RecordingStream(httpcore.AsyncNetworkStream):
    def __init__(self, host: str, writes: list[tuple[str, str]]) -> None:
        self.host, self.writes, self.unanswered = host, writes, 0

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        if not buffer:  # the end of a body of known length: nothing goes out (as httpcore's socket streams skip it)
            return
        await asyncio.sleep(0)  # as anyio's socket send yields to the loop before each write
        headers = buffer.startswith(b"POST ")
        self.writes.append((self.host, "headers" if headers else "body"))
        self.unanswered += headers

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        if not self.unanswered:
            return b""
        self.unanswered -= 1
        body, kind = (b"{}", b"application/json") if self.host == "prefill" else (SSE, b"text/event-stream")
        return b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s" % (kind, len(body), body)

    async def aclose(self) -> None:
        pass


def test_the_prompt_leaves_whole_before_the_decode_call_starts(monkeypatch):
    """httpx writes a request's headers and body in two writes, yielding between them: with both calls
    started at once the decode call's headers went out between the prompt's headers and its body, and
    the prefill server's handler (started by the headers) waited for the body."""
    backend = RecordingBackend()
    real = httpx.AsyncClient

    def recording_client(**kw) -> httpx.AsyncClient:
        transport = httpx.AsyncHTTPTransport()
        transport._pool = httpcore.AsyncConnectionPool(network_backend=backend)  # no public hook for the backend
        return real(transport=transport, **kw)

    monkeypatch.setattr(httpx, "AsyncClient", recording_client)
    with TestClient(create_router_app(["http://prefill:1"], ["http://decode:2"], health_every_s=None)) as router:
        for _ in range(2):
            reply = router.post("/v1/chat/completions", content=json.dumps(BODY))
            assert reply.status_code == 200 and reply.content == SSE
    assert backend.writes == [("prefill", "headers"), ("prefill", "body"), ("decode", "headers"),
                              ("decode", "body")] * 2


class RoomBackend(httpcore.AsyncNetworkBackend):
    """Upstreams that behave like a PD pair's: a prefill call is answered only once the decode call of
    its room has reached the decode server (the room opened); a decode call is answered at once."""

    def __init__(self) -> None:
        self.rooms: dict[str, asyncio.Event] = {}

    def room(self, name: str) -> asyncio.Event:
        return self.rooms.setdefault(name, asyncio.Event())

    async def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
        return RoomStream(host, self)


class RoomStream(RecordingStream):
    def __init__(self, host: str, backend: RoomBackend) -> None:
        super().__init__(host, [])
        self.backend = backend
        self.opened: asyncio.Event | None = None

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        await super().write(buffer, timeout)
        if buffer.startswith(b"POST "):
            room = self.backend.room(next(line.split(b":", 1)[1].strip().decode() for line in buffer.split(b"\r\n")
                                          if line.lower().startswith(ROOM_HEADER.encode())))
            if self.host == "decode":
                room.set()
            else:
                self.opened = room

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        if self.unanswered and self.opened is not None:
            await self.opened.wait()
            self.opened = None
        return await super().read(max_bytes, timeout)


def test_more_requests_than_a_default_connection_pool_all_finish():
    """Each request holds two upstream connections, and its prefill call's only until its decode call
    arrives: with httpx's default cap of 100 connections, 100 prefill calls (which now leave before
    their decode calls) held them all while their decode calls waited for one - a wedge until the PD
    deadline."""
    backend = RoomBackend()

    def room_client(**kw) -> httpx.AsyncClient:
        client = httpx.AsyncClient(**kw)
        client._transport._pool._network_backend = backend  # no public hook for the backend
        return client

    app = create_router_app(["http://prefill:1"], ["http://decode:2"], make_client=room_client, health_every_s=None)

    async def run() -> list[int]:
        async with app.router.lifespan_context(app), httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                                                       base_url="http://router") as client:
            replies = asyncio.gather(*(client.post("/v1/chat/completions", content=json.dumps(BODY))
                                       for _ in range(130)))
            return [reply.status_code for reply in await asyncio.wait_for(replies, 20)]

    assert asyncio.run(run()) == [200] * 130


def test_a_burst_spreads_its_upstream_connections_over_the_pools():
    """httpx's pool costs O(connections^2) per request queued or released: one pool of the ~160 upstream
    connections of the 80-session gate took 82% of the router's loop on the H200. With the pools, no
    pool holds more than its share of a burst's connections (one pool held all 260 here)."""
    backend = RoomBackend()
    made: list[httpx.AsyncClient] = []

    def room_client(**kw) -> httpx.AsyncClient:
        client = httpx.AsyncClient(**kw)
        client._transport._pool._network_backend = backend  # no public hook for the backend
        made.append(client)
        return client

    requests, pools = 130, 16
    app = create_router_app(["http://prefill:1"], ["http://decode:2"], pools=pools, make_client=room_client,
                            health_every_s=None)

    async def run() -> tuple[list[int], list[int]]:
        async with app.router.lifespan_context(app), httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                                                       base_url="http://router") as client:
            replies = asyncio.gather(*(client.post("/v1/chat/completions", content=json.dumps(BODY))
                                       for _ in range(requests)))
            codes = [reply.status_code for reply in await asyncio.wait_for(replies, 20)]
            return codes, [len(c._transport._pool.connections) for c in made]

    codes, held = asyncio.run(run())
    assert codes == [200] * requests
    assert len(held) == pools and sum(held) >= requests  # a burst this size opens connections (the mock
    # answers a prefill call only once its decode call arrived: each request holds two at once)
    assert max(held) <= 2 * -(-requests // pools), held
    assert app.state.pool_loads.in_flight == [0] * pools


def test_requests_one_at_a_time_all_take_the_first_pool_and_give_it_back():
    """One request at a time finds pool 0's kept-alive connections: taken in turn over the 16 pools,
    a quiet router's requests found their pool's connections expired (httpx keeps them 5 s) and paid a
    new one before the prompt left. Each pool is given back once its request is over, streamed or not,
    and a client that hangs up mid-stream gives it back too. Under the old turn-taking the requests'
    calls went through pools 0, 1, 2, ..."""
    used: list[int] = []

    def numbered_client(**kw) -> httpx.AsyncClient:
        number = len(made)

        def answer(request: httpx.Request) -> httpx.Response:
            if request.url.path != "/health":
                used.append(number)
            if request.url.host == "prefill":
                return httpx.Response(200, json={})
            return httpx.Response(200, stream=httpx.ByteStream(SSE), headers={"content-type": "text/event-stream"})

        made.append(httpx.AsyncClient(transport=httpx.MockTransport(answer), **kw))
        return made[-1]

    made: list[httpx.AsyncClient] = []
    app = create_router_app(["http://prefill:1"], ["http://decode:2"], pools=4, make_client=numbered_client,
                            health_every_s=None)
    with TestClient(app) as router:
        for stream in (True, False, True, False, True):
            reply = router.post("/v1/chat/completions", content=json.dumps({**BODY, "stream": stream}))
            assert reply.status_code == 200
        with router.stream("POST", "/v1/chat/completions", content=json.dumps(BODY)) as reply:
            next(reply.iter_bytes())  # hang up after the first bytes
        assert used == [0] * 12, used
        assert app.state.pool_loads.in_flight == [0] * 4


def test_the_router_refuses_no_pools():
    with pytest.raises(ValueError, match="at least one upstream connection pool"):
        create_router_app(["http://prefill:1"], ["http://decode:2"], pools=0)


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


def pd_fleet(prefill_state: dict[str, str], decode_error: dict[str, tuple[int, str]] | None = None,
             decode_state: dict[str, str] | None = None):
    """Mock upstreams: prefill servers by host, each "ok", "stopping" (its 503, and the decode side's
    report of it) or "down" (nothing listens); decode servers by host (`decode_state`, default one "ok"
    server), "down" or streaming SSE unless the prefill server named in the request's bootstrap header
    is not ok (or `decode_error` names an error for that server). Returns (the router app, the log of
    (host, bootstrap host) per upstream request)."""
    from runtime.disagg.protocol import BOOTSTRAP_HEADER

    seen: list[tuple[str, str]] = []

    def error(status: int, code: str) -> httpx.Response:
        return httpx.Response(status, json={"error": {"message": "planted", "type": "server_error", "code": code}})

    def answer(request: httpx.Request) -> httpx.Response:
        host, bootstrap = request.url.host, httpx.URL(request.headers[BOOTSTRAP_HEADER]).host
        seen.append((host, bootstrap))
        if (decode_state or {}).get(host) == "down":
            raise httpx.ConnectError("[Errno 111] Connection refused", request=request)
        state = prefill_state.get(bootstrap, "ok")
        if host in prefill_state:  # the prompt's call
            if state == "down":
                raise httpx.ConnectError("[Errno 111] Connection refused", request=request)
            return error(503, "pd_prefill_stopping") if state == "stopping" else httpx.Response(200, json={})
        if (decode_error or {}).get(bootstrap):  # a decode server's answer from here on
            return error(*(decode_error or {})[bootstrap])
        if state == "stopping":
            return error(503, "pd_prefill_stopping")
        if state == "down":
            return error(502, "pd_prefill_unreachable")
        return httpx.Response(200, stream=httpx.ByteStream(SSE), headers={"content-type": "text/event-stream"})

    transport = httpx.MockTransport(answer)
    app = create_router_app([f"http://{host}:1" for host in prefill_state],
                            [f"http://{host}:2" for host in decode_state or {"decode": "ok"}],
                            make_client=lambda **kw: httpx.AsyncClient(transport=transport, **kw),
                            health_every_s=None)  # the request path's retries alone
    return app, seen


@pytest.mark.parametrize("state", ["stopping", "down"])
def test_a_request_a_prefill_server_takes_nothing_of_goes_to_the_next_one(state):
    """A prefill server shutting down (503 pd_prefill_stopping) or down (nothing listens) took nothing of
    the request and the client has had nothing: the router offers it to the next prefill server, and
    passes the first over for the next requests (UPSTREAM_REST_S). Every request is served. Negative
    control: the old router answered the error to every request it sent there."""
    app, seen = pd_fleet({"prefill-a": state, "prefill-b": "ok"})
    with TestClient(app) as router:
        replies = [router.post("/v1/chat/completions", content=json.dumps(BODY)) for _ in range(4)]
    assert [(r.status_code, r.content) for r in replies] == [(200, SSE)] * 4
    decode_calls = [bootstrap for host, bootstrap in seen if host == "decode"]
    assert decode_calls == ["prefill-a", "prefill-b", "prefill-b", "prefill-b", "prefill-b"]


def test_a_prefill_server_the_decode_side_cannot_reach_is_passed_over():
    """A rolling restart's race (CI, 2026-12-05): the prompt went over a kept-alive connection to a
    prefill server whose listening socket then closed, so the decode side's room call could not connect
    and it answered 502 pd_prefill_unreachable. No room opened, no KV landed, the client has had
    nothing: the router offers the request to the next prefill server. Negative control: the router
    before this answered the 502 to the client."""
    app, seen = pd_fleet({"prefill-a": "ok", "prefill-b": "ok"},
                         decode_error={"prefill-a": (502, "pd_prefill_unreachable")})
    with TestClient(app) as router:
        replies = [router.post("/v1/chat/completions", content=json.dumps(BODY)) for _ in range(3)]
    assert [(r.status_code, r.content) for r in replies] == [(200, SSE)] * 3
    assert [bootstrap for host, bootstrap in seen if host == "decode"] == ["prefill-a", "prefill-b", "prefill-b",
                                                                           "prefill-b"]


def test_a_failure_after_the_prefill_server_took_the_request_is_not_retried():
    """A KV that arrived corrupt (or any error but the two above) may come after the prefill server
    computed the prompt: the router answers it as it is and offers the request to no one else."""
    app, seen = pd_fleet({"prefill-a": "ok", "prefill-b": "ok"}, decode_error={"prefill-a": (502, "pd_kv_corrupt")})
    with TestClient(app) as router:
        first = router.post("/v1/chat/completions", content=json.dumps(BODY))
    assert (first.status_code, first.json()["error"]["code"]) == (502, "pd_kv_corrupt")
    assert {bootstrap for _, bootstrap in seen} == {"prefill-a"}


def test_with_every_prefill_server_stopping_the_client_gets_the_error():
    app, seen = pd_fleet({"prefill-a": "stopping", "prefill-b": "stopping"})
    with TestClient(app) as router:
        reply = router.post("/v1/chat/completions", content=json.dumps(BODY))
    assert (reply.status_code, reply.json()["error"]["code"]) == (503, "pd_prefill_stopping")
    assert sorted(bootstrap for host, bootstrap in seen if host == "decode") == ["prefill-a", "prefill-b"]


def test_a_decode_server_nothing_listens_on_hands_the_room_to_the_next_one():
    """The first decode server is down: the request's room goes to the next decode server, and the
    prompt's call stands (no prompt computed twice); the down server is passed over for the next
    requests. Negative control: the old router answered 502 pd_upstream_unreachable to every request
    it sent there."""
    app, seen = pd_fleet({"prefill": "ok"}, decode_state={"decode-a": "down", "decode-b": "ok"})
    with TestClient(app) as router:
        replies = [router.post("/v1/chat/completions", content=json.dumps(BODY)) for _ in range(3)]
    assert [(r.status_code, r.content) for r in replies] == [(200, SSE)] * 3
    assert [host for host, _ in seen] == ["prefill", "decode-a", "decode-b"] + ["prefill", "decode-b"] * 2
