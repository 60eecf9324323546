"""The router's lean HTTP/1.1 client (runtime/upstream_http.py) against in-memory servers
(tests/fake_upstreams.py) and hand-written answers: framing (Content-Length, chunked, to the close),
keep-alive reuse and its limits, a request in one write, and every failure as an UpstreamError."""

from __future__ import annotations

import asyncio
import socket

import pytest

from runtime import upstream_http
from runtime.upstream_http import UpstreamConnectError, UpstreamError, Upstreams, UpstreamTimeout
from tests.fake_upstreams import FakeReply, FakeRequest, FakeUpstreams

pytestmark = pytest.mark.unit


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


def echo(request: FakeRequest) -> FakeReply:
    return FakeReply(200, b"%s %s %s" % (request.method.encode(), request.path.encode(), request.body))


def test_bodies_framed_by_length_and_by_chunks_read_whole_and_as_they_arrive():
    chunks = [b"data: 1\n\n", b"data: 22\n\n", b"x" * 70_000]

    def answer(request: FakeRequest) -> FakeReply:
        return FakeReply(chunks=list(chunks)) if request.path == "/chunked" else echo(request)

    async def go():
        fake = FakeUpstreams(answer)
        upstreams = Upstreams(5.0, connect=fake.connect)
        reply = await upstreams.request("POST", "http://a:1/x?q=1", {"x-k": "v"}, b"body")
        assert (reply.status_code, await reply.aread()) == (200, b"POST /x?q=1 body")
        assert fake.requests[0].headers["x-k"] == "v" and fake.requests[0].headers["host"] == "a:1"
        reply = await upstreams.request("GET", "http://a:1/chunked")
        assert reply.headers["transfer-encoding"] == "chunked"
        assert [piece async for piece in reply.aiter_raw()] == chunks  # the server's chunks, de-chunked
        await reply.aclose()
        assert fake.connections == 1  # both calls over one kept-alive connection
        await upstreams.aclose()
        await asyncio.sleep(0.01)
        assert fake.closed == 1 and upstreams.is_closed
        with pytest.raises(UpstreamConnectError, match="the client is closed"):
            await upstreams.request("GET", "http://a:1/x")

    run(go())


def test_a_request_goes_out_in_one_write():
    """Head and body together: httpx's two writes let another call's head in between, and the prefill
    server's handler then waited for the prompt's body."""
    writes: list[bytes] = []

    async def go():
        fake = FakeUpstreams(echo)

        async def recording(host, port):
            reader, writer = await fake.connect(host, port)
            real = writer.write
            writer.write = lambda data: (writes.append(bytes(data)), real(data))[1]  # type: ignore[method-assign]
            return reader, writer

        upstreams = Upstreams(5.0, connect=recording)
        await (await upstreams.request("POST", "http://a:1/p", {}, b"the prompt")).aread()

    run(go())
    assert len(writes) == 1
    assert writes[0].startswith(b"POST /p HTTP/1.1\r\n") and writes[0].endswith(b"\r\n\r\nthe prompt")


def test_connections_are_not_reused_after_close_idle_or_an_unread_body(monkeypatch):
    async def go():
        fake = FakeUpstreams(lambda r: FakeReply(200, b"bye", close=True) if r.path == "/close" else echo(r))
        upstreams = Upstreams(5.0, connect=fake.connect)
        await (await upstreams.request("GET", "http://a:1/close")).aread()
        await (await upstreams.request("GET", "http://a:1/x")).aread()
        assert fake.connections == 2  # "connection: close" was honoured
        reply = await upstreams.request("GET", "http://a:1/x")
        await reply.aclose()  # the body left unread: the connection is closed, not given back
        await (await upstreams.request("GET", "http://a:1/x")).aread()
        assert fake.connections == 3
        monkeypatch.setattr(upstream_http, "IDLE_S", 0.0)  # every idle connection has expired
        await (await upstreams.request("GET", "http://a:1/x")).aread()
        assert fake.connections == 4
        await asyncio.sleep(0.01)
        assert fake.closed == 2  # by the client: the unread body's and the expired one's

    run(go())


def test_a_server_that_closed_its_idle_connection_is_not_reused():
    async def go():
        fake = FakeUpstreams(echo)
        upstreams = Upstreams(5.0, connect=fake.connect)
        await (await upstreams.request("GET", "http://a:1/x")).aread()
        for task in list(fake._serving):  # the server side goes away (a restart): its end closes
            task.cancel()
        await asyncio.sleep(0.01)
        await (await upstreams.request("GET", "http://a:1/x")).aread()
        assert fake.connections == 2

    run(go())


def refuse_writes(writer) -> None:
    """`writer` refuses every write as uvloop does for a transport the server reset just before it:
    RuntimeError, nothing sent."""
    def refused(data):
        raise RuntimeError("unable to perform operation on <TCPTransport closed=True>; the handler is closed")

    writer.write = refused


def test_a_connection_closed_before_its_request_was_written_is_replaced_or_is_a_connect_error():
    """A kept-alive connection the server had reset goes unused: a fresh one carries the request. A fresh
    connection reset before the write means the server took nothing: UpstreamConnectError, which the
    router reads as "offer the request elsewhere" (the router's own plain 500, before: the PD chaos test
    saw three when a prefill server was killed)."""
    async def go():
        fake = FakeUpstreams(echo)
        upstreams = Upstreams(5.0, connect=fake.connect)
        await (await upstreams.request("GET", "http://a:1/x")).aread()
        refuse_writes(upstreams._idle[("a", 1)][-1].writer)  # the kept-alive connection, reset
        assert await (await upstreams.request("GET", "http://a:1/y")).aread()
        assert upstreams.opened == 2  # a fresh connection carried it

        async def reset_at_once(host, port):
            reader, writer = await fake.connect(host, port)
            refuse_writes(writer)
            return reader, writer

        with pytest.raises(UpstreamConnectError, match="closed the connection before the request was written"):
            await Upstreams(5.0, connect=reset_at_once).request("GET", "http://a:1/z")
        assert [r.path for r in fake.requests] == ["/x", "/y"]  # /z never reached the server

    run(go())


def test_a_cancelled_call_closes_its_connection_which_the_server_reads_as_given_up():
    async def go():
        answered = asyncio.Event()

        async def slow(request: FakeRequest) -> FakeReply:
            answered.set()
            await asyncio.sleep(30)
            return FakeReply()

        fake = FakeUpstreams(slow)
        upstreams = Upstreams(5.0, connect=fake.connect)
        call = asyncio.create_task(upstreams.request("POST", "http://a:1/room", {}, b"p"))
        await answered.wait()
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        await asyncio.sleep(0.01)
        assert upstreams._idle == {} and fake.requests[0].body == b"p"

    run(go())


def test_failures_are_upstream_errors_that_say_what_happened():
    async def go():
        fake = FakeUpstreams(echo, down={"down"})
        upstreams = Upstreams(0.2, connect=fake.connect)
        with pytest.raises(UpstreamConnectError, match="cannot connect to down:1"):
            await upstreams.request("GET", "http://down:1/x")

        async def silent(request: FakeRequest) -> FakeReply:
            await asyncio.sleep(5)
            return FakeReply()

        with pytest.raises(UpstreamTimeout, match="sent nothing for 0.2 s"):
            await Upstreams(0.2, connect=FakeUpstreams(silent).connect).request("GET", "http://a:1/x")

        for answer, match in ((b"SSH-2.0-OpenSSH\r\n\r\n", "not an HTTP/1.x answer"),
                              (b"HTTP/1.1 200 OK\r\nno colon\r\n\r\n", "malformed header line"),
                              (b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nshort", "closed the connection 5 bytes"),
                              (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n", "malformed chunk size"),
                              (b"HTTP/1.1 200 OK\r\ncontent-length: x\r\n\r\n", "malformed Content-Length"),
                              (b"HTTP/1.1 200 OK\r\nx-big: " + b"a" * 70_000 + b"\r\n\r\n", "exceeds 65536 bytes")):
            with pytest.raises(UpstreamError, match=match):
                await (await Upstreams(1.0, connect=canned(answer)).request("GET", "http://a:1/x")).aread()

    run(go())


def canned(answer: bytes):
    """A connect whose server reads one request head, writes `answer` and closes."""

    async def connect(host, port):
        ours, theirs = socket.socketpair()

        async def serve():
            reader, writer = await asyncio.open_connection(sock=theirs)
            await reader.readuntil(b"\r\n\r\n")
            writer.write(answer)
            await writer.drain()
            writer.close()

        connect.task = asyncio.get_running_loop().create_task(serve())  # type: ignore[attr-defined]
        return await asyncio.open_connection(sock=ours)

    return connect


def test_a_body_read_to_the_close_and_an_http10_answer_are_not_reused():
    async def go():
        upstreams = Upstreams(1.0, connect=canned(b"HTTP/1.0 200 OK\r\n\r\nall of it"))
        reply = await upstreams.request("GET", "http://a:1/x")
        assert await reply.aread() == b"all of it" and upstreams._idle == {}

    run(go())


def test_bad_urls_and_header_injection_are_refused_before_anything_is_sent():
    async def go():
        upstreams = Upstreams(1.0, connect=FakeUpstreams(echo).connect)
        with pytest.raises(ValueError, match="plain http://"):
            await upstreams.request("GET", "https://a:1/x")
        with pytest.raises(ValueError, match="line break"):
            await upstreams.request("GET", "http://a:1/x", {"x-a": "v\r\nx-evil: 1"})
    run(go())
    with pytest.raises(ValueError, match="timeouts must be positive"):
        Upstreams(0)


def test_lines_are_whole_across_chunk_boundaries():
    """The /pd/transfer answer's lines (the first carries the first token) arrive in whatever chunks the
    server wrote: a line split over two chunks is one line, CRLF and a last line without a break too."""
    pieces = [b'{"first": 1', b'}\n{"done"', b': 2}\r\n\n', b"tail"]

    async def go():
        fake = FakeUpstreams(lambda request: FakeReply(chunks=list(pieces)))
        reply = await Upstreams(5.0, connect=fake.connect).request("POST", "http://a:1/pd/transfer", {}, b"{}")
        return [line async for line in reply.aiter_lines()]

    assert run(go()) == [b'{"first": 1}', b'{"done": 2}', b"", b"tail"]
