"""In-memory HTTP/1.1 upstreams for the router's unit tests, plugged in as runtime/upstream_http.py's
`connect`: each connection is a socket pair whose far end a small server task answers, in the caller's
event loop, with `answer(request)` (a function or a coroutine function), request after request on the
kept-alive connection. A host named in `down` refuses connections, as a port nothing listens on does.
`CannedUpstreams` skips the sockets: each call is answered (or fails) in the caller's task.

Replies go out with a Content-Length, or chunked when `FakeReply.chunks` is given (the decode side's
SSE stream). The log keeps, in arrival order, each request once read whole, and each connection the
router closed (`closed`), so tests can tell what reached which upstream, in which order.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import socket
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from runtime.upstream_http import json_payload, lines_of


@dataclass
class FakeRequest:
    method: str
    host: str  # the Host header's name, without its port
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class FakeReply:
    status: int = 200
    body: bytes = b""
    content_type: str = "application/json"
    # Sent chunked, one write per chunk, instead of `body`; an async iterator streams until the router
    # hangs up (counted in `FakeUpstreams.closed`).
    chunks: list[bytes] | AsyncIterator[bytes] | None = None
    close: bool = False  # answer with "connection: close" and close after it

    @classmethod
    def json(cls, status: int, value: object) -> FakeReply:
        return cls(status, json.dumps(value).encode())


SSE_TYPE = "text/event-stream"


@dataclass
class FakeUpstreams:
    answer: Callable
    down: set[str] = field(default_factory=set)
    requests: list[FakeRequest] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)  # hosts a connection to was refused, in order
    connections: int = 0  # opened so far
    closed: int = 0  # connections the router closed (read EOF on our side)
    _serving: set[asyncio.Task] = field(default_factory=set)

    async def connect(self, host: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if host in self.down:
            self.refused.append(host)
            raise ConnectionRefusedError(111, "Connection refused")
        ours, theirs = socket.socketpair()
        self.connections += 1
        server_reader, server_writer = await asyncio.open_connection(sock=theirs)
        task = asyncio.get_running_loop().create_task(self._serve(server_reader, server_writer))
        self._serving.add(task)
        task.add_done_callback(self._serving.discard)
        return await asyncio.open_connection(sock=ours)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    self.closed += 1
                    return
                lines = head.decode("latin-1").split("\r\n")
                method, target, _ = lines[0].split(" ", 2)
                headers = {name.strip().lower(): value.strip()
                           for name, _, value in (line.partition(":") for line in lines[1:] if line)}
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                request = FakeRequest(method, headers["host"].rsplit(":", 1)[0], target, headers, body)
                self.requests.append(request)
                reply = self.answer(request)
                if inspect.isawaitable(reply):
                    reply = await reply
                if not await self._send(reader, writer, reply):
                    self.closed += 1
                    return
                if reply.close:
                    writer.close()
                    return
        except (ConnectionError, asyncio.CancelledError):
            return
        finally:
            writer.close()  # the server's end goes away with its task (a restart, in a test)

    @staticmethod
    async def _send(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, reply: FakeReply) -> bool:
        """Send the reply; False when the router hung up on a streamed one before its end."""
        head = [f"HTTP/1.1 {reply.status} X", f"content-type: {reply.content_type}"]
        if reply.close:
            head.append("connection: close")
        if reply.chunks is None:
            head.append(f"content-length: {len(reply.body)}")
            writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + reply.body)
        elif isinstance(reply.chunks, list):
            head.append("transfer-encoding: chunked")
            writer.write(("\r\n".join(head) + "\r\n\r\n").encode())
            for chunk in reply.chunks:
                writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                await writer.drain()
            writer.write(b"0\r\n\r\n")
        else:
            head.append("transfer-encoding: chunked")
            writer.write(("\r\n".join(head) + "\r\n\r\n").encode())
            hung_up = asyncio.ensure_future(reader.read(1))  # b"" once the router closes the connection
            try:
                async for chunk in reply.chunks:
                    if hung_up.done():
                        return False
                    writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    await writer.drain()
                    await asyncio.wait([hung_up], timeout=0)
            finally:
                hung_up.cancel()  # and its read given up before the next request's head is read
                await asyncio.gather(hung_up, return_exceptions=True)
            writer.write(b"0\r\n\r\n")
        await writer.drain()
        return True

    def hosts(self, path: str = "/v1/chat/completions") -> list[str]:
        """The hosts that requests for `path` reached, in order."""
        return [request.host for request in self.requests if request.path == path]


class CannedReply:
    """What `CannedUpstreams.request` returns: an UpstreamReply's reading methods over a FakeReply."""

    def __init__(self, reply: FakeReply) -> None:
        self.status_code, self.headers = reply.status, {"content-type": reply.content_type}
        self._reply, self.closed = reply, False

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        chunks = self._reply.chunks
        if chunks is None:
            yield self._reply.body
        elif isinstance(chunks, list):
            for chunk in chunks:
                yield chunk
        else:
            async for chunk in chunks:
                yield chunk

    def aiter_lines(self) -> AsyncIterator[bytes]:
        return lines_of(self.aiter_raw())

    async def aread(self) -> bytes:
        return b"".join([piece async for piece in self.aiter_raw()])

    async def aclose(self) -> None:
        self.closed = True


@dataclass
class CannedUpstreams:
    """An `Upstreams` stand-in whose `request` hands each call to `answer(request)` (a function or a
    coroutine function) in the caller's task, with no connection at all: `answer` may raise
    UpstreamConnectError (nothing listens) or UpstreamError (a connection that broke) as it likes,
    call by call, where the socket-backed FakeUpstreams can refuse only a connection it has not made."""

    answer: Callable
    requests: list[FakeRequest] = field(default_factory=list)

    async def request(self, method: str, url: str, headers: dict[str, str] | None = None,
                      body: bytes = b"", json_body: object = None) -> CannedReply:
        if json_body is not None:
            headers, body = json_payload(headers, json_body)
        parts = urlsplit(url)
        request = FakeRequest(method, parts.hostname or "", parts.path, dict(headers or {}), body)
        self.requests.append(request)
        reply = self.answer(request)
        if inspect.isawaitable(reply):
            reply = await reply
        return CannedReply(reply)

    async def aclose(self) -> None:
        pass
