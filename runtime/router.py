"""The PD router: one OpenAI-compatible front for prefill and decode servers.

    python -m runtime.router --prefill URL [--prefill URL ...] --decode URL [--decode URL ...]
        [--host 127.0.0.1] [--port 30000] [--timeout S] [--health-every S]

Each chat request gets a fresh room id and goes, unchanged, to one prefill server and one decode server
(round robin) with the room and the prefill server's URL in two headers (runtime/disagg/protocol.py).
The client gets the decode server's answer, streamed through byte for byte (a stream's first token
relayed from the prefill server, below); a request either side
fails reaches the client as an OpenAI-shaped error (the decode side reports the prefill side's): an
error status, or, once a stream is open, an error event inside it, as the colocated server does after
admission. A stream opens as soon as the decode side has opened the request's room, while the prompt
computes, so neither server's response start lies on the first token's path. A prefill server that
took nothing of a request (shutting down, or down) is passed over for a moment and the request offered
to the next one, up to MAX_PREFILL_TRIES servers, the client having had nothing yet: before its answer
starts, or inside its open stream when that stream's first event is the refusal (`relay`).
Likewise a decode server that cannot be reached: the same room goes to the next one (MAX_DECODE_TRIES).
Every upstream's /health is polled in the background (runtime/router_health.py): a server failing it
is passed over until it passes again, and the router's own /health is 200 only while each role has a
healthy server. Every upstream call goes through runtime/upstream_http.py's lean HTTP/1.1 client:
two of them lie on each request's first-token path. A stream's first token comes from the prefill
server's answer, which the router asks to relay it (runtime/disagg/protocol.py): prefill server ->
router -> client, not prefill -> decode -> router -> client.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import sys
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from runtime.disagg.protocol import (
    BOOTSTRAP_HEADER,
    CREATED_HEADER,
    RELAY_HEADER,
    RELAY_MEDIA_TYPE,
    RELAYED_EVENT,
    ROOM_HEADER,
    relayed_bytes,
    settle_relay,
)
from runtime.router_health import HEALTH_EVERY_S, UpstreamHealth
from runtime.server.errors import ApiError, sse_event
from runtime.server.http_stack import HTTP, LOOP
from runtime.server.prometheus_text import parse_samples, sample_sum
from runtime.server.trace import NO_TRACE, TRACE_HEADER, Trace, TraceLog
from runtime.upstream_http import (
    Connect,
    Exchange,
    UpstreamConnectError,
    UpstreamError,
    UpstreamReply,
    Upstreams,
    lines_of,
)

FORWARDED_HEADERS = ("authorization", "content-type", TRACE_HEADER)
# Upstream samples the router's /metrics sums over the pair (the gate's page-leak and preemption
# checks and its prefix-cache summary read them off the one URL they know), each with the per-upstream
# series it is listed under.
PAIR_SUMS = {"dsv4_kv_pages_in_use": "dsv4_pd_upstream_kv_pages_in_use",
             "dsv4_kv_pages_cached": "dsv4_pd_upstream_kv_pages_cached",
             "dsv4_preemptions_total": "dsv4_pd_upstream_preemptions_total",
             "dsv4_prefix_cache_hit_tokens_total": "dsv4_pd_upstream_prefix_cache_hit_tokens_total",
             "dsv4_prefix_cache_lookup_tokens_total": "dsv4_pd_upstream_prefix_cache_lookup_tokens_total"}
# Prefill servers a request is offered to when the ones before took nothing of it (shutting down, down
# or out of the decode side's reach: `_prefill_refused`), nothing having reached its client yet; each
# try but one refused at its connection costs a decode call.
MAX_PREFILL_TRIES = 3
# The decode side's errors that say the prefill server took nothing of a request (`_prefill_refused`).
PREFILL_REFUSED_CODES = frozenset({"pd_prefill_stopping", "pd_prefill_unreachable"})
# Decode servers a request's room is offered to when the ones before could not be reached (nothing
# listens: the room was not opened, and the prompt's call waits for whichever decode server opens it).
MAX_DECODE_TRIES = 3
# How long an upstream that took nothing of a request is passed over by the next requests: a prefill
# server draining for a shutdown refuses everything for up to its grace period (5 s, `GRACEFUL_SHUTDOWN_S`
# in runtime/server/serving.py), and a server that is down stays down; a retry after this shows whether
# it is back.
UPSTREAM_REST_S = 2.0
Answer = TypeVar("Answer")  # what one upstream's try gives the request (`offer`)


def _kind(name: str) -> str:
    return "counter" if name.endswith("_total") else "gauge"


def _unreachable(role: str, url: str, exc: Exception) -> Response:
    return ApiError(502, f"{role} server {url} unreachable: {exc!r}", type="server_error",
                    code="pd_upstream_unreachable").response()


# Prefill calls left to run to their end by a request whose client hung up (`_settle`): held here, as
# nothing else refers to them once the request's stream is gone.
_SETTLING: set[asyncio.Task] = set()


async def _settle(task: asyncio.Task) -> None:
    """Wait for the prefill call to end (it answers once the room is done or failed), without ending it.
    A caller cancelled meanwhile (a client that hung up cancels its stream's tasks) leaves the call to
    run to its end: the prefill side finishes the room it is writing, and the decode side, which holds
    the client's abort until the request's admission, frees both ends. Cancelling the call instead
    closes its connection, which the prefill server takes as the request given up: the router does that
    on purpose only when the decode side failed (`prefill_call.cancel()` before this)."""
    try:
        await asyncio.shield(task)
    except UpstreamError:
        pass
    except asyncio.CancelledError:
        if task.cancelled():
            return  # the call was cancelled on purpose, and has ended
        _SETTLING.add(task)  # let go by `_settled`, the call's done-callback since its start
        raise


def _settled(task: asyncio.Task) -> None:
    _SETTLING.discard(task)
    if not task.cancelled():
        task.exception()  # retrieved: an upstream failure after the client left is nobody's to report


async def _prefill_answer(exchange: Exchange, first: asyncio.Future) -> bytes:
    """The prompt's call's answer, read whole (so its connection is reused). A relaying answer's first
    line, the client's first bytes (runtime/disagg/protocol.py), goes to `first` as soon as it is in; any
    other answer, or one that breaks off before that line, sets `first` to None (nothing to relay)."""
    try:
        reply = await exchange.reply()
        if reply.status_code != 200 or not reply.headers.get("content-type", "").startswith(RELAY_MEDIA_TYPE):
            return await reply.aread()
        lines = lines_of(reply.aiter_raw())
        head = await anext(lines, b"")
        settle_relay(first, relayed_bytes(head))
        rest = [line async for line in lines]
        await reply.aclose()
        return b"\n".join([head, *rest])
    finally:
        settle_relay(first, None)


async def _get(upstreams: Upstreams, url: str, headers: dict[str, str] | None = None) -> tuple[UpstreamReply, bytes]:
    reply = await upstreams.request("GET", url, headers)
    return reply, await reply.aread()


def create_router_app(prefill: list[str], decode: list[str], timeout_s: float = 60.0,
                      health_every_s: float | None = HEALTH_EVERY_S, connect: Connect | None = None) -> FastAPI:
    """The router's app. `health_every_s`: the upstreams' /health poll period; None polls nothing.
    `connect` opens each upstream connection (default: TCP; tests put in-memory upstreams under it)."""
    if not prefill or not decode:
        raise ValueError("the router needs at least one --prefill and one --decode server")
    pick_prefill, pick_decode = itertools.cycle(prefill), itertools.cycle(decode)
    resting: dict[str, float] = {}  # upstream URL -> the loop time until which requests pass it over

    health = UpstreamHealth({"prefill": prefill, "decode": decode}, health_every_s)

    def next_up(pick: Iterator[str], count: int) -> str:
        """The next server of `pick` in turn that is neither resting (`UPSTREAM_REST_S`) nor failing
        its health polls (runtime/router_health.py); the next in turn when all are."""
        now = asyncio.get_running_loop().time()
        for _ in range(count):
            url = next(pick)
            if resting.get(url, 0.0) <= now and health.healthy(url):
                return url
        return next(pick)

    def rest(url: str) -> None:
        resting[url] = asyncio.get_running_loop().time() + UPSTREAM_REST_S

    async def offer(url: str, pick: Iterator[str], count: int, tries: int,
                    send: Callable[[str], Awaitable[tuple[Answer, bool]]], trace: Trace, retried: str) -> Answer:
        """`send` a request to `url`, then, while the server took nothing of it (`send` says so beside its
        answer), to the next server of `pick` (`count` servers) not resting, up to `tries` servers in all.
        A server that took nothing rests (the last one too); the trace is marked `retried` before each
        next server. The last server's answer is returned as it came, took nothing or not."""
        for left in reversed(range(tries)):
            answer, took_nothing = await send(url)
            if not took_nothing:
                return answer
            rest(url)
            if not left:
                return answer
            trace.mark(retried)
            url = next_up(pick, count)
        raise AssertionError("unreachable: the last try returns")

    # No cap on connections: a request holds two at once, its prefill call's until its decode call has
    # opened the room (under httpx's default cap of 100 a burst of prefill calls once held every
    # connection while their decode calls waited for one - a wedge until the PD deadline).
    upstreams = Upstreams(timeout_s, connect=connect)
    traces = TraceLog()

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        # One poll before serving, so the router's /health is the pair's from its first answer.
        await health.poll_once(check_health)
        poller = asyncio.create_task(health.run(check_health))
        yield
        poller.cancel()
        await asyncio.gather(poller, return_exceptions=True)
        await upstreams.aclose()

    async def check_health(url: str) -> int:
        return (await _get(upstreams, f"{url}/health"))[0].status_code

    app = FastAPI(title="dsv4 PD router", lifespan=lifespan)
    app.state.upstreams = upstreams  # read by tests

    async def proxy_get(request: Request, path: str) -> Response:
        url = next_up(pick_decode, len(decode))
        try:
            reply, content = await _get(upstreams, f"{url}{path}", _forwarded(request))
        except UpstreamError as exc:
            return _unreachable("decode", url, exc)
        return Response(content, status_code=reply.status_code, media_type=reply.headers.get("content-type"))

    @app.get("/health")
    async def health_route() -> Response:
        """200 while at least one prefill and one decode server pass their health polls, else 503
        naming the role with none; each upstream's last poll in the body."""
        status, body = health.report()
        return Response(json.dumps(body), status_code=status, media_type="application/json")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await proxy_get(request, "/v1/models")

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        """The pair's figures that a gate reads off one server (PAIR_SUMS: KV pages in use, 0 when
        nothing leaked on either side; pages cached; preemptions; prefix-cache hit and lookup tokens),
        summed over the upstreams, then each upstream's figure by role; each server's own /metrics has
        its transfer metrics."""
        sums = dict.fromkeys(PAIR_SUMS, 0.0)
        lines: list[str] = []
        for role, urls in (("prefill", prefill), ("decode", decode)):
            for url in urls:
                try:
                    text = (await _get(upstreams, f"{url}/metrics", _forwarded(request)))[1].decode()
                except UpstreamError:
                    continue
                samples = parse_samples(text)
                for name, series in PAIR_SUMS.items():
                    value = sample_sum(samples, name)
                    if value is not None:
                        sums[name] += value
                        lines.append(f'{series}{{role="{role}",url="{url}"}} {value}')
        head = [line for name, value in sums.items()
                for line in (f"# TYPE {name.removesuffix('_total')} {_kind(name)}", f"{name} {value}")]
        return Response("\n".join([*head, *lines, *health.metric_lines()]) + "\n",
                        media_type="text/plain; version=0.0.4")

    @app.get("/server_info")
    async def server_info(request: Request) -> Response:
        return await proxy_get(request, "/server_info")

    @app.get("/debug/trace/{key}")
    async def debug_trace(request: Request, key: str) -> Response:
        """The request's phase marks here and on the upstreams that kept them (runtime/server/trace.py)."""
        found: dict[str, dict] = {}
        marks = traces.marks(key)
        if marks is not None:
            found["router"] = marks
        for role, urls in (("prefill", prefill), ("decode", decode)):
            for url in urls:
                try:
                    reply, content = await _get(upstreams, f"{url}/debug/trace/{key}", _forwarded(request))
                except UpstreamError:
                    continue
                if reply.status_code == 200:
                    found[role] = json.loads(content)["marks"]
        if not found:
            return ApiError(404, f"no trace {key!r} is kept by the router or its upstreams",
                            code="not_found").response()
        return Response(json.dumps(found), media_type="application/json")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        trace = traces.start(request.headers)
        trace.mark("received")
        body = await request.body()
        try:
            stream = json.loads(body).get("stream") is True
        except (ValueError, AttributeError):
            stream = False  # the servers answer the malformed body with their own 400
        decode_url = next_up(pick_decode, len(decode))
        # Both servers write the stream's chunks with this `created`; a stream's first token comes from the
        # prefill server through here (RELAY_HEADER), one hop shorter than through the decode server.
        shared = {CREATED_HEADER: str(int(time.time())), **({RELAY_HEADER: "1"} if stream else {})}

        async def decode_reply(headers: dict[str, str]) -> UpstreamReply:
            """The decode call, offered to the next decode server while nothing listens where it goes: no
            room was opened there, so the prompt's call (which waits for any decode server to open its
            room) stands, and another decode server may open it."""

            async def decode_try(url: str) -> tuple[UpstreamReply | UpstreamConnectError, bool]:
                nonlocal decode_url
                decode_url = url  # the server a failure names (`_unreachable`)
                try:
                    exchange = await upstreams.send("POST", f"{url}/v1/chat/completions", headers, body)
                except UpstreamConnectError as exc:
                    return exc, True
                return await exchange.reply(), False

            reply = await offer(decode_url, pick_decode, len(decode), min(len(decode), MAX_DECODE_TRIES),
                                decode_try, trace, "decode_retried")
            if isinstance(reply, UpstreamConnectError):
                raise reply
            return reply

        tries = min(len(prefill), MAX_PREFILL_TRIES)
        tried = 0  # prefill servers offered the request so far

        async def prefill_try(prefill_url: str) -> tuple[Response | OpenStream, bool]:
            """The request through `prefill_url` and a decode server: the client's answer (a stream the
            decode side opened, not yet read), and whether the prefill server took nothing of it
            (`_prefill_refused`), the client having had nothing yet."""
            nonlocal tried
            tried += 1
            headers = {**_forwarded(request), **shared, ROOM_HEADER: uuid.uuid4().hex, BOOTSTRAP_HEADER: prefill_url}
            # The prompt's call is the critical path: it is written whole before the decode call starts,
            # which only opens the room and has the prompt's compute time to do it.
            try:
                exchange = await upstreams.send("POST", f"{prefill_url}/v1/chat/completions", headers, body)
            except UpstreamConnectError as exc:  # nothing listens: it took nothing, and no room is opened
                return _unreachable("prefill", prefill_url, exc), True
            except UpstreamError as exc:  # broke off as it was written: it may have taken part of it
                return _unreachable("prefill", prefill_url, exc), False
            trace.mark("prefill_sent")
            first: asyncio.Future = asyncio.get_running_loop().create_future()
            prefill_call = asyncio.create_task(_prefill_answer(exchange, first))
            # Its failure is read where it is awaited (`_settle`), or by nobody: a stream whose client left
            # before the stream's first write never runs `relay`.
            prefill_call.add_done_callback(_settled)
            try:
                reply = await decode_reply(headers)
            except UpstreamError as exc:
                prefill_call.cancel()
                await _settle(prefill_call)
                return _unreachable("decode", decode_url, exc), False
            trace.mark("decode_headers")
            if reply.status_code == 200 and stream:  # open: the room is, and the prompt computes
                return OpenStream(reply, prefill_call, prefill_url, first), False
            try:
                content = await reply.aread()
            except UpstreamError as exc:
                prefill_call.cancel()
                await _settle(prefill_call)
                return _unreachable("decode", decode_url, exc), False
            if reply.status_code != 200:
                # The decode side failed, maybe before it opened the room: hang up on the prefill server,
                # which then frees the prompt's KV it holds for the room at once, not at its deadline.
                prefill_call.cancel()
            await _settle(prefill_call)
            answer = Response(content, status_code=reply.status_code, media_type=reply.headers.get("content-type"))
            # Nothing reached the client yet: another prefill server may take a request this one refused.
            return answer, reply.status_code != 200 and _prefill_refused(content)

        async def pair(prefill_url: str) -> Response | OpenStream:
            """The request offered to `prefill_url`, then to the next prefill servers while each took
            nothing of it, up to MAX_PREFILL_TRIES in all for the request."""
            return await offer(prefill_url, pick_prefill, len(prefill), tries - tried, prefill_try, trace,
                               "prefill_retried")

        async def relay(opened: OpenStream) -> AsyncIterator[bytes]:
            """The decode side's stream, to the client byte for byte. The decode side opens it as the room
            opens and holds everything for the first token (runtime/server/app.py `_stream`), so the client's
            stream starts while the prompt computes, with its headers alone. The first token's bytes come from
            the prefill server when it relays them (`_prefill_answer`), the moment they are in: the decode
            stream has RELAYED_EVENT in their place, which is taken out (`_after_relay`). A first event that
            says the prefill server took nothing of the request (`_prefill_refused`: a drain that failed the
            room, the prompt's answer broken off before its first line) is the router's, not the client's:
            the request goes to the next prefill server (tries left), whose stream follows in its place."""
            while True:
                reading = asyncio.ensure_future(_first_event(opened))
                relayed: bytes | None = None  # the first token's bytes, once the client has them
                try:
                    await asyncio.wait((opened.first, reading), return_when=asyncio.FIRST_COMPLETED)
                    relayed = opened.first.result() if opened.first.done() else None
                    if relayed is not None:  # the usual order: the relay is in before the decode side's marker
                        yield _relayed(relayed, trace)
                    head = await reading
                    marked = _relayed_head(head)  # the head after the decode side's marker, if it starts with one
                    if relayed is None and marked is not None:  # the marker first: the relay is due
                        relayed = await asyncio.shield(opened.first)
                        if relayed is not None:
                            yield _relayed(relayed, trace)
                except BaseException:  # the client went away: as `_pass_through` does then
                    await _hang_up(opened, reading)
                    raise
                if relayed is not None:  # the client has its first token: no other prefill server from here on
                    after = _after_relay(head, marked)
                    if isinstance(after, ApiError):
                        await _hang_up(opened, reading)
                        yield after.event().encode()
                        return
                    head = after
                elif marked is not None:  # relayed by the prefill server, lost on the way here
                    await _hang_up(opened, reading)
                    yield RELAY_LOST.event().encode()
                    return
                elif head.broke is None and tried < tries and _prefill_refused(_event_data(head.event)):
                    await _close(opened)
                    rest(opened.prefill_url)
                    trace.mark("prefill_retried")
                    answer = await pair(next_up(pick_prefill, len(prefill)))
                    if isinstance(answer, OpenStream):
                        opened = answer
                        continue
                    yield _as_event(answer)  # the client's stream is open: the error goes inside it
                    return
                # Closed with this generator (a client that went away), not left to the garbage collector.
                async with aclosing(_pass_through(opened, head, trace)) as chunks:
                    async for chunk in chunks:
                        yield chunk
                return

        answer = await pair(next_up(pick_prefill, len(prefill)))
        if isinstance(answer, OpenStream):
            return StreamingResponse(relay(answer), media_type="text/event-stream")
        return answer

    return app


def _is_error(data: bytes) -> bool:
    """Whether an event's data is an OpenAI error body."""
    try:
        return isinstance(json.loads(data).get("error"), dict)
    except (ValueError, AttributeError):
        return False


def _prefill_refused(decode_error: bytes) -> bool:
    """Whether a failed pair's request may go to another prefill server: the client has had nothing,
    and the prefill server kept nothing of it. So when it is shutting down (the decode side reports its
    503 `pd_prefill_stopping`) or the decode side could not reach it (502 `pd_prefill_unreachable`: its
    room was not opened, or its answer broke off, so no KV landed; the prompt's call, hung up by the
    caller, frees what the prefill server holds for it). The last happens in a rolling restart: a
    prompt sent over a kept-alive connection reaches a server whose listening socket closed before the
    decode side's room call. (A prefill server nothing listens on is passed over before any decode call.)"""
    try:
        error = json.loads(decode_error).get("error")
    except (ValueError, AttributeError):
        return False
    return isinstance(error, dict) and error.get("code") in PREFILL_REFUSED_CODES


@dataclass
class OpenStream:
    """A decode server's stream that answered 200 (its room is open), not yet read, and the prompt's call
    beside it. `chunks` is the stream's body as it comes (`_first_event` reads its head); `first` gets the
    first bytes the prefill server relays, or None (`_prefill_answer`)."""

    reply: UpstreamReply
    prefill_call: asyncio.Task
    prefill_url: str
    first: asyncio.Future
    chunks: AsyncIterator[bytes] = field(init=False)

    def __post_init__(self) -> None:
        self.chunks = self.reply.aiter_raw()


@dataclass
class StreamHead:
    """What `_first_event` read of a stream: its first event (up to its blank line; what came, if the
    stream ended or broke off first), every chunk read to get it, and the break, if it broke off."""

    event: bytes
    chunks: list[bytes]
    broke: UpstreamError | None = None


async def _first_event(opened: OpenStream) -> StreamHead:
    head = StreamHead(b"", [])
    buffer = b""
    try:
        async for chunk in opened.chunks:
            head.chunks.append(chunk)
            buffer += chunk
            end = buffer.find(b"\n\n")
            if end >= 0:
                head.event = buffer[:end]
                return head
    except UpstreamError as exc:
        head.broke = exc
    head.event = buffer
    return head


RELAYED = RELAYED_EVENT.encode()
RELAY_LOST = ApiError(502, "the prefill server's answer broke off before the first token it relayed reached the "
                           "router", type="server_error", code="pd_stream_broken")


def _relayed_head(head: StreamHead) -> StreamHead | None:
    """A decode stream's head without its leading RELAYED_EVENT (what followed it stays), or None when
    the stream does not start with it."""
    data = b"".join(head.chunks)
    if not data.startswith(RELAYED):
        return None
    rest = data[len(RELAYED):]
    return StreamHead(b"", [rest] if rest else [], head.broke)


def _after_relay(head: StreamHead, marked: StreamHead | None) -> StreamHead | ApiError:
    """What of a decode stream goes to a client that has its first token from the prefill server: all
    after RELAYED_EVENT (`marked`, the head's `_relayed_head`); an error in its place as it is (the decode
    side failed before it took the token); any other first event is a decode server that wrote the token
    again, which the client must not get twice."""
    if marked is not None:
        return marked
    if head.broke is not None or _is_error(_event_data(head.event)):
        return head
    return ApiError(502, "the decode server wrote the first token the prefill server had relayed",
                    type="server_error", code="pd_relay_mismatch")


async def _hang_up(opened: OpenStream, reading: asyncio.Future) -> None:
    """The client went away (or the stream ends early): stop reading the decode stream, close it and wait
    for the prompt's call (never cancelled: as `_pass_through`)."""
    reading.cancel()
    await asyncio.gather(reading, return_exceptions=True)
    await opened.reply.aclose()
    await _settle(opened.prefill_call)


def _event_data(event: bytes) -> bytes:
    """An SSE event's data (its `data:` lines joined), as `_prefill_refused` reads an error body."""
    return b"\n".join(line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:"))


def _as_event(answer: Response) -> bytes:
    """A pair's error answer as the last event of a stream already open (the OpenAI error body the
    colocated server sends inside a stream), and the stream's end."""
    try:
        error = json.loads(bytes(answer.body))
    except ValueError:
        error = ApiError(502, f"upstream answered {answer.status_code}: {bytes(answer.body)[:200]!r}",
                         type="server_error", code="pd_upstream_error").body()
    return f"{sse_event(error)}data: [DONE]\n\n".encode()


async def _close(opened: OpenStream) -> None:
    """Give up an open stream whose prefill server took nothing of the request: close the decode call and
    hang up on the prompt's call, then wait for it to end."""
    await opened.reply.aclose()
    opened.prefill_call.cancel()
    await _settle(opened.prefill_call)


async def _pass_through(opened: OpenStream, head: StreamHead, trace: Trace = NO_TRACE) -> AsyncGenerator[bytes, None]:
    """The decode stream's chunks (`head`'s, then as they come); a stream that broke off ends with the
    error inside it. Then the decode call is closed (a client that went away closes it mid-stream: its
    request is aborted there) and the prompt's call is waited for, never cancelled: the prefill side
    finishes the room it may be writing, and the decode side frees both ends."""
    try:
        broke = head.broke
        if head.chunks:  # one write for what came before the first event ended
            yield _relayed(b"".join(head.chunks), trace)
        if broke is None:
            try:
                async for chunk in opened.chunks:
                    yield _relayed(chunk, trace)
            except UpstreamError as exc:
                broke = exc
        if broke is not None:  # the decode server died mid-stream: say so inside the stream
            error = ApiError(502, f"decode server stream broke: {broke!r}", type="server_error",
                             code="pd_stream_broken")
            yield error.event().encode()
    finally:
        await opened.reply.aclose()
        await _settle(opened.prefill_call)


def _relayed(chunk: bytes, trace: Trace) -> bytes:
    if trace is not NO_TRACE and chunk.count(b'"content": "') > chunk.count(b'"content": ""'):
        trace.mark("first_token_relayed")  # the first chunk with text (the role chunk has none)
    return chunk


def _forwarded(request: Request) -> dict[str, str]:
    return {name: request.headers[name] for name in FORWARDED_HEADERS if name in request.headers}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runtime.router", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefill", action="append", required=True, metavar="URL")
    parser.add_argument("--decode", action="append", required=True, metavar="URL")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--timeout", type=float, default=600.0, help="longest wait for an upstream answer")
    parser.add_argument("--health-every", type=float, default=HEALTH_EVERY_S, metavar="S",
                        help="seconds between polls of each upstream's /health (a failing server is passed over)")
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    import uvicorn

    if not args.health_every > 0:
        parser.error(f"--health-every must be positive, got {args.health_every}")
    if not args.timeout > 0:
        parser.error(f"--timeout must be positive, got {args.timeout}")
    urls = [u.rstrip("/") for u in args.prefill], [u.rstrip("/") for u in args.decode]
    for url in (*urls[0], *urls[1]):
        if not url.startswith("http://"):
            parser.error(f"upstreams are plain http:// URLs, got {url!r}")
    app = create_router_app(*urls, timeout_s=args.timeout, health_every_s=args.health_every)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level.lower(), timeout_keep_alive=75,
                loop=LOOP, http=HTTP)
    return 0


if __name__ == "__main__":
    sys.exit(main())
