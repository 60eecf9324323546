"""A lean HTTP/1.1 client for the PD router's calls to its upstreams (runtime/router.py).

The router's two calls per request lie on the first token's path: the prompt's call to the prefill
server before the prompt step, the decode server's stream after it. Through httpx each cost about a
millisecond of the router's own time on the 2-core host (`bench.pd_ttft --phases`: 1.15 ms from the
request's arrival to the prompt's body written, 0.95 ms from the decode side's first token to the
router's relay of it), and a loopback round trip through httpx took 0.8 ms against 0.2 ms for the same
bytes over a bare asyncio stream. At 8-word prompts those milliseconds are what kept the PD pair's TTFT
above 1.2x the colocated server's (issue 16).

What it speaks, and no more: a request with a body of known length, written in one write (head and
body together: the prompt reaches the prefill server whole, and its handler never waits for a body
that a second write would bring); answers framed by Content-Length, by the chunked transfer coding, or
by the connection's close. Connections are kept alive per origin and reused last-in first-out, each
for at most IDLE_S idle; the servers keep theirs 75 s (runtime/serve.py), so a server never closes one
as it is reused. There is no cap on connections (the router's calls may hold many at once: see
runtime/router.py) and no pool bookkeeping beyond a list per origin: httpcore's walk of every pooled
connection on each request was the router's bottleneck under the 80-session PD gate.

A call that fails raises `UpstreamError`; `UpstreamConnectError` when nothing could be sent (nothing
listens), which tells the router the upstream took nothing of the request. A reply whose body was not
read to its end, or whose reading was cancelled, closes its connection: the server takes a closed
connection as the request given up (the PD sides' abort path), and the connection could not be reused.
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

# How long a kept-alive connection may wait idle before it is closed instead of reused: under the PD
# servers' keep-alive (75 s, runtime/serve.py), so a quiet router's prompt call still finds its connection
# (a new one costs its connect on the TTFT path; httpx kept them 5 s). A server that closes sooner (uvicorn's
# default is 5 s) is seen closed before reuse: its FIN has been read (`_Connection.reusable`), but for a
# close that crosses the reuse itself.
IDLE_S = 60.0
# The largest status line + headers read from an upstream, and the largest read of a body at a time.
MAX_HEAD_BYTES = 64 * 1024
READ_BYTES = 64 * 1024

Connect = Callable[[str, int], Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]]


class UpstreamError(Exception):
    """An upstream call failed (refused, broken off, timed out, or answered something that is not HTTP/1.x)."""


class UpstreamConnectError(UpstreamError):
    """No connection could be made: the upstream received nothing of the request."""


class UpstreamTimeout(UpstreamError):
    """The upstream sent nothing for the call's timeout."""


async def _open_connection(host: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection(host, port, limit=MAX_HEAD_BYTES)


@dataclass
class _Connection:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    idle_since: float = 0.0

    def reusable(self, now: float) -> bool:
        # A connection the server closed (or that broke) reads EOF once the loop has seen it.
        return (not self.reader.at_eof() and self.reader.exception() is None and not self.writer.is_closing()
                and now - self.idle_since < IDLE_S)

    def close(self) -> None:
        self.writer.close()


@dataclass
class UpstreamReply:
    """An upstream's answer: its status and headers (names lower-cased) are read; the body is read
    with `aread` (whole) or `aiter_raw` (as it arrives, de-chunked), and `aclose` ends the call."""

    status_code: int
    headers: dict[str, str]
    _pool: Upstreams = field(repr=False)
    _origin: tuple[str, int] = field(repr=False)
    _connection: _Connection | None = field(repr=False)
    _length: int | None = field(repr=False)  # None: chunked, or to the close (_chunked says which)
    _chunked: bool = field(repr=False)
    _done: bool = field(default=False, repr=False)

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive (chunk boundaries are the server's, de-chunked)."""
        connection = self._connection
        if connection is None or self._done:
            return
        try:
            if self._chunked:
                async for data in self._chunks(connection.reader):
                    yield data
            elif self._length is not None:
                left = self._length
                while left:
                    data = await self._pool._read(connection.reader.read(min(left, READ_BYTES)))
                    if not data:
                        raise UpstreamError(f"the upstream closed the connection {left} bytes before the body's end")
                    left -= len(data)
                    yield data
            else:
                while data := await self._pool._read(connection.reader.read(READ_BYTES)):
                    yield data
                self.headers["connection"] = "close"  # read to the close: nothing to reuse
            self._done = True
        finally:
            if not self._done:  # broken off, cancelled, or the caller stopped iterating: the call is given up
                self._release(reuse=False)

    async def _chunks(self, reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
        read = self._pool._read
        while True:
            line = await read(reader.readuntil(b"\r\n"))
            try:
                size = int(line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                raise UpstreamError(f"a malformed chunk size line from the upstream: {line[:80]!r}") from None
            if size == 0:
                while await read(reader.readuntil(b"\r\n")) != b"\r\n":  # trailers, up to the blank line
                    pass
                return
            data = await read(reader.readexactly(size + 2))
            if data[-2:] != b"\r\n":
                raise UpstreamError("a chunk from the upstream did not end in CRLF")
            yield data[:-2]

    def aiter_lines(self) -> AsyncIterator[bytes]:
        """The body's lines as they arrive, each without its line break (a last line without one too)."""
        return lines_of(self.aiter_raw())

    async def aread(self) -> bytes:
        parts = [data async for data in self.aiter_raw()]
        await self.aclose()
        return b"".join(parts)

    async def aclose(self) -> None:
        """End the call: a body read to its end gives the connection back for reuse; otherwise (the
        caller stops early: a client that went away) the connection is closed, which the server reads
        as the request given up."""
        self._release(reuse=self._done and self.headers.get("connection", "").lower() != "close")

    def _release(self, reuse: bool) -> None:
        connection, self._connection = self._connection, None
        if connection is None:
            return
        if reuse:
            self._pool._give_back(self._origin, connection)
        else:
            connection.close()


class Upstreams:
    """Kept-alive HTTP/1.1 connections to the upstreams, and the calls through them.
    `timeout_s`: the longest wait for the upstream's next bytes (its answer's head, or the next piece of
    its body); `connect`: how a connection is opened (tests put in-memory upstreams under it);
    `headers`: sent with every request (a call's own headers of the same name win)."""

    def __init__(self, timeout_s: float, connect_timeout_s: float = 5.0, connect: Connect | None = None,
                 headers: dict[str, str] | None = None) -> None:
        if not timeout_s > 0 or not connect_timeout_s > 0:
            raise ValueError(f"upstream timeouts must be positive, got {timeout_s} s and {connect_timeout_s} s")
        self.timeout_s, self.connect_timeout_s = timeout_s, connect_timeout_s
        self._connect = connect or _open_connection
        self.headers = {name.lower(): value for name, value in (headers or {}).items()}
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self.opened = 0  # connections opened so far
        self.is_closed = False  # by `aclose`: no call is sent from then on

    async def request(self, method: str, url: str, headers: dict[str, str] | None = None,
                      body: bytes = b"", json_body: object = None) -> UpstreamReply:
        """Send the request and read its answer's head (the body is the reply's to read). `json_body`:
        sent as the body, JSON-encoded, with its content type."""
        if json_body is not None:
            headers, body = json_payload(headers, json_body)
        return await (await self.send(method, url, headers, body)).reply()

    async def send(self, method: str, url: str, headers: dict[str, str] | None = None,
                   body: bytes = b"") -> Exchange:
        """Write the request, head and body in one write, and return once it is written; its answer
        comes from the exchange's `reply()`. Raises UpstreamConnectError when nothing could be sent."""
        origin, target = _split(url)
        if self.is_closed:  # a call racing its server's shutdown: refused as nothing listening would be
            raise UpstreamConnectError(f"the client is closed: nothing was sent to {origin[0]}:{origin[1]}")
        if self.headers:
            headers = {**self.headers, **{name.lower(): value for name, value in (headers or {}).items()}}
        head = _request_head(method, target, origin, headers or {}, len(body))
        connection = self._take(origin)
        while True:
            fresh = connection is None
            if connection is None:
                try:
                    reader, writer = await asyncio.wait_for(self._connect(*origin), self.connect_timeout_s)
                except (OSError, TimeoutError) as exc:
                    raise UpstreamConnectError(f"cannot connect to {origin[0]}:{origin[1]}: {exc!r}") from exc
                self.opened += 1
                connection = _Connection(reader, writer)
            try:
                connection.writer.write(head + body)
            except (OSError, RuntimeError) as exc:
                # Refused at once, so nothing went out: the server closed (reset) the connection before
                # this write, uvloop raising RuntimeError for its closed transport. A server being killed
                # does that to a connection it had just accepted (the PD chaos test, three of 893
                # requests once). A kept-alive one is replaced by a fresh connection; a fresh one means
                # the server takes nothing now.
                connection.close()
                if fresh:
                    raise UpstreamConnectError(f"{origin[0]}:{origin[1]} closed the connection before the request "
                                               f"was written: {exc!r}") from exc
                connection = None
                continue
            break
        try:
            await self._read(connection.writer.drain())
        except BaseException as exc:
            connection.close()
            if isinstance(exc, (OSError, RuntimeError)):
                raise UpstreamError(f"the request to {url} broke off as it was written: {exc!r}") from exc
            raise
        return Exchange(self, origin, connection, method)

    def _take(self, origin: tuple[str, int]) -> _Connection | None:
        idle, now = self._idle.get(origin), asyncio.get_running_loop().time()
        while idle:
            connection = idle.pop()
            if connection.reusable(now):
                return connection
            connection.close()
        return None

    def _give_back(self, origin: tuple[str, int], connection: _Connection) -> None:
        connection.idle_since = asyncio.get_running_loop().time()
        self._idle.setdefault(origin, []).append(connection)

    async def _read(self, awaitable: Awaitable) -> bytes:
        """One read (or drain) under the call's timeout, its failures as UpstreamError. (A timeout scope,
        not asyncio.wait_for: that wraps each read in a task of its own, on the first token's path.)"""
        try:
            async with asyncio.timeout(self.timeout_s):
                return await awaitable
        except TimeoutError:
            raise UpstreamTimeout(f"the upstream sent nothing for {self.timeout_s} s") from None
        except asyncio.IncompleteReadError as exc:
            raise UpstreamError(f"the upstream closed the connection mid-answer ({len(exc.partial)} bytes read)") \
                from None
        except asyncio.LimitOverrunError:
            raise UpstreamError(f"a line from the upstream exceeds {MAX_HEAD_BYTES} bytes") from None
        except OSError as exc:
            raise UpstreamError(f"the upstream connection broke: {exc!r}") from exc

    async def aclose(self) -> None:
        """Close every idle connection and refuse calls from now on (replies still being read close
        theirs as they end)."""
        self.is_closed = True
        for idle in self._idle.values():
            for connection in idle:
                connection.close()
        self._idle.clear()


@dataclass
class Exchange:
    """A request that has been written, waiting for its answer."""

    pool: Upstreams
    origin: tuple[str, int]
    connection: _Connection
    method: str

    async def reply(self) -> UpstreamReply:
        """The answer's status and headers. A failure, or a cancellation (the caller hangs up), closes
        the connection."""
        try:
            status, headers = await self._read_head()
        except BaseException:
            self.connection.close()
            raise
        chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        length = None if chunked else _content_length(headers)
        if self.method == "HEAD" or status in (204, 304) or 100 <= status < 200:
            length, chunked = 0, False
        reply = UpstreamReply(status, headers, self.pool, self.origin, self.connection, length, chunked)
        if length == 0:
            reply._done = True
        return reply

    async def _read_head(self) -> tuple[int, dict[str, str]]:
        # The whole head in one read (the reader's limit, MAX_HEAD_BYTES, bounds it).
        head = await self.pool._read(self.connection.reader.readuntil(b"\r\n\r\n"))
        status_line, *lines = head[:-4].split(b"\r\n")
        parts = status_line.split(None, 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
            raise UpstreamError(f"not an HTTP/1.x answer from the upstream: {status_line[:80]!r}")
        headers: dict[str, str] = {}
        for line in lines:
            name, sep, value = line.decode("latin-1").partition(":")
            if not sep:
                raise UpstreamError(f"a malformed header line from the upstream: {line[:80]!r}")
            key = name.strip().lower()
            # Repeated headers are joined as RFC 9110 allows (none the router reads may repeat otherwise).
            headers[key] = f"{headers[key]}, {value.strip()}" if key in headers else value.strip()
        if parts[0] == b"HTTP/1.0" and headers.get("connection", "").lower() != "keep-alive":
            headers["connection"] = "close"
        return int(parts[1]), headers


def json_payload(headers: dict[str, str] | None, value: object) -> tuple[dict[str, str], bytes]:
    """`headers` with the JSON content type, and `value` JSON-encoded as the body."""
    return {**(headers or {}), "content-type": "application/json"}, json.dumps(value).encode()


async def lines_of(pieces: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Lines, without their line breaks, of a body arriving in `pieces` (a last line without one too)."""
    pending = b""
    async for data in pieces:
        pending += data
        *lines, pending = pending.split(b"\n")
        for line in lines:
            yield line.removesuffix(b"\r")
    if pending:
        yield pending


def _content_length(headers: dict[str, str]) -> int | None:
    value = headers.get("content-length")
    if value is None:
        return None
    if not value.strip().isdigit():
        raise UpstreamError(f"a malformed Content-Length from the upstream: {value[:40]!r}")
    return int(value)


@functools.lru_cache(maxsize=1024)  # a few upstreams' few routes, on every call's path
def _split(url: str) -> tuple[tuple[str, int], str]:
    """(host, port) and the request target of an http:// URL."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"the router's upstreams are plain http:// URLs, got {url!r}")
    target = parts.path or "/"
    if parts.query:
        target += f"?{parts.query}"
    return (parts.hostname, parts.port or 80), target


def _request_head(method: str, target: str, origin: tuple[str, int], headers: dict[str, str], length: int) -> bytes:
    lines = [f"{method} {target} HTTP/1.1", f"host: {origin[0]}:{origin[1]}"]
    for name, value in headers.items():
        if name.lower() in ("host", "content-length", "transfer-encoding", "connection"):
            continue  # this client frames the request itself
        if any(c in name or c in value for c in "\r\n\0"):
            raise ValueError(f"a header with a line break or NUL cannot be sent: {name!r}")
        lines.append(f"{name}: {value}")
    if length or method not in ("GET", "HEAD"):
        lines.append(f"content-length: {length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
