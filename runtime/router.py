"""The PD router: one OpenAI-compatible front for prefill and decode servers.

    python -m runtime.router --prefill URL [--prefill URL ...] --decode URL [--decode URL ...]
        [--host 127.0.0.1] [--port 30000] [--timeout S] [--upstream-pools N] [--health-every S]

Each chat request gets a fresh room id and goes, unchanged, to one prefill server and one decode server
(round robin) with the room and the prefill server's URL in two headers (runtime/disagg/protocol.py).
The client gets the decode server's answer, streamed through byte for byte; a request either side
fails reaches the client as an OpenAI-shaped error (the decode side reports the prefill side's). A
prefill server that took nothing of a request (shutting down, or down) is passed over for a moment and
the request offered to the next one, up to MAX_PREFILL_TRIES servers: the client has had nothing yet.
Likewise a decode server that cannot be reached: the same room goes to the next one (MAX_DECODE_TRIES).
Every upstream's /health is polled in the background (runtime/router_health.py): a server failing it
is passed over until it passes again, and the router's own /health is 200 only while each role has a
healthy server.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from typing import TypeVar

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from runtime.disagg.protocol import BOOTSTRAP_HEADER, ROOM_HEADER
from runtime.router_health import HEALTH_EVERY_S, UpstreamHealth
from runtime.server.errors import ApiError
from runtime.server.prometheus_text import parse_samples, sample_sum
from runtime.server.trace import NO_TRACE, TRACE_HEADER, Trace, TraceLog

FORWARDED_HEADERS = ("authorization", "content-type", TRACE_HEADER)
# Upstream samples the router's /metrics sums over the pair (the gate's page-leak and preemption
# checks and its prefix-cache summary read them off the one URL they know), each with the per-upstream
# series it is listed under.
PAIR_SUMS = {"dsv4_kv_pages_in_use": "dsv4_pd_upstream_kv_pages_in_use",
             "dsv4_kv_pages_cached": "dsv4_pd_upstream_kv_pages_cached",
             "dsv4_preemptions_total": "dsv4_pd_upstream_preemptions_total",
             "dsv4_prefix_cache_hit_tokens_total": "dsv4_pd_upstream_prefix_cache_hit_tokens_total",
             "dsv4_prefix_cache_lookup_tokens_total": "dsv4_pd_upstream_prefix_cache_lookup_tokens_total"}


# httpcore 1.0's pool walks every connection it holds on each request it queues and each it releases,
# and for each idle one counts the idle ones again: O(N^2) a pass. Under the 80-session PD gate on the
# H200 the router held ~160 upstream connections in one pool and spent 82% of its event loop in that
# walk (py-spy, 2026-12-04): the router was the pair's bottleneck (750 tok/s, TTFT p50 1.06 s, against
# the colocated server's 2,372 tok/s and 0.05 s). A request's two calls go through one of this many
# pools, the least busy (`PoolLoads`), so each pool holds about 1/UPSTREAM_POOLS of a burst's connections.
UPSTREAM_POOLS = 16
# Where a request notes the pool it took (the ASGI scope's state), for `PoolLoads.give_back`.
POOL_KEY = "router_upstream_pool"
# Prefill servers a request is offered to when the ones before took nothing of it (shutting down, down
# or out of the decode side's reach: `_prefill_refused`), nothing having reached its client yet; each
# try costs a decode call.
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


class PoolLoads:
    """Which upstream pool a request's calls go through: the one with the fewest requests in flight,
    the lowest-numbered among equals. One request at a time therefore always finds pool 0's kept-alive
    connections (in turn over 16 pools, a router serving fewer than ~3 requests a second found each
    pool's connections expired - httpx keeps them 5 s - and paid a new one on its TTFT path: 0.3-0.4 ms
    on the 2-core host), and a burst still spreads evenly (`UPSTREAM_POOLS` says why it must)."""

    def __init__(self, pools: int) -> None:
        self.in_flight = [0] * pools

    def take(self) -> int:
        pool = min(range(len(self.in_flight)), key=self.in_flight.__getitem__)
        self.in_flight[pool] += 1
        return pool

    def give_back(self, scope: Scope) -> None:
        """Give back the pool a request took, noted under POOL_KEY in its scope's state (if any)."""
        pool = scope.get("state", {}).get(POOL_KEY)
        if pool is not None:
            self.in_flight[pool] -= 1


class GiveBackPools:
    """ASGI middleware: once a request is over - after its whole answer, a streamed one too, or its
    cancellation - the upstream pool it took goes back (`PoolLoads.give_back`)."""

    def __init__(self, app: ASGIApp, loads: PoolLoads) -> None:
        self.app, self.loads = app, loads

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.app(scope, receive, send)
        finally:
            self.loads.give_back(scope)


def _kind(name: str) -> str:
    return "counter" if name.endswith("_total") else "gauge"


def _unreachable(role: str, url: str, exc: Exception) -> Response:
    return ApiError(502, f"{role} server {url} unreachable: {exc!r}", type="server_error",
                    code="pd_upstream_unreachable").response()


async def _settle(task: asyncio.Task) -> None:
    """Let the prefill call end (it answers once the room is done or failed; a cancelled call closes
    its connection, which the prefill server takes as the request given up)."""
    try:
        await task
    except (httpx.HTTPError, asyncio.CancelledError):
        pass


def create_router_app(prefill: list[str], decode: list[str], timeout_s: float = 60.0,
                      pools: int = UPSTREAM_POOLS, health_every_s: float | None = HEALTH_EVERY_S,
                      make_client: Callable[..., httpx.AsyncClient] | None = None) -> FastAPI:
    """The router's app. `make_client` builds each upstream pool's client from httpx.AsyncClient's
    keyword arguments (default: httpx.AsyncClient; bench/router_pools.py puts in-memory upstreams
    under them). `health_every_s`: the upstreams' /health poll period; None polls nothing."""
    if not prefill or not decode:
        raise ValueError("the router needs at least one --prefill and one --decode server")
    if pools < 1:
        raise ValueError(f"the router needs at least one upstream connection pool, got {pools}")
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

    loads = PoolLoads(pools)
    clients: list[httpx.AsyncClient] = []  # clients[0] also carries the GETs (health, metrics, traces)
    traces = TraceLog()

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        # No cap on connections, nor on those kept alive: a request holds two, its prefill call's until
        # its decode call has opened the room, and the decode call starts only once the prompt's body is
        # out, so under httpx's default cap (100) a burst of prefill calls held every connection while
        # their decode calls waited for one - a wedge until the PD deadline. Connections beyond the
        # default 20 kept alive were closed after each use, and the next request paid a new one.
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        make = make_client or httpx.AsyncClient
        clients[:] = [make(timeout=httpx.Timeout(timeout_s, connect=5.0), limits=limits) for _ in range(pools)]
        # One poll before serving, so the router's /health is the pair's from its first answer.
        await health.poll_once(check_health)
        poller = asyncio.create_task(health.run(check_health))
        yield
        poller.cancel()
        await asyncio.gather(poller, return_exceptions=True)
        await asyncio.gather(*(client.aclose() for client in clients))

    async def check_health(url: str) -> int:
        return (await clients[0].get(f"{url}/health", timeout=health.timeout_s)).status_code

    app = FastAPI(title="dsv4 PD router", lifespan=lifespan)

    async def proxy_get(request: Request, path: str) -> Response:
        url = next_up(pick_decode, len(decode))
        try:
            reply = await clients[0].get(f"{url}{path}", headers=_forwarded(request))
        except httpx.HTTPError as exc:
            return _unreachable("decode", url, exc)
        return Response(reply.content, status_code=reply.status_code,
                        media_type=reply.headers.get("content-type"))

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
                    text = (await clients[0].get(f"{url}/metrics", headers=_forwarded(request))).text
                except httpx.HTTPError:
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
                    reply = await clients[0].get(f"{url}/debug/trace/{key}", headers=_forwarded(request))
                except httpx.HTTPError:
                    continue
                if reply.status_code == 200:
                    found[role] = reply.json()["marks"]
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
        pool = loads.take()
        request.scope.setdefault("state", {})[POOL_KEY] = pool  # given back by `GiveBackPools`
        client = clients[pool]

        async def decode_reply(headers: dict[str, str], prompt_sent: asyncio.Event) -> httpx.Response:
            """The decode call, offered to the next decode server while nothing listens where it goes: no
            room was opened there, so the prompt's call (which waits for any decode server to open its
            room) stands, and another decode server may open it."""

            async def decode_try(url: str) -> tuple[httpx.Response | httpx.ConnectError, bool]:
                nonlocal decode_url
                decode_url = url  # the server a failure names (`_unreachable`)
                try:
                    return await _open_decode(client, url, body, headers, prompt_sent, trace), False
                except httpx.ConnectError as exc:
                    return exc, True

            reply = await offer(decode_url, pick_decode, len(decode), min(len(decode), MAX_DECODE_TRIES),
                                decode_try, trace, "decode_retried")
            if isinstance(reply, httpx.ConnectError):
                raise reply
            return reply

        async def prefill_try(prefill_url: str) -> tuple[Response, bool]:
            """The request through `prefill_url` and a decode server: the client's answer, and whether the
            prefill server took nothing of it (`_prefill_refused`), the client having had nothing yet."""
            headers = {**_forwarded(request), ROOM_HEADER: uuid.uuid4().hex, BOOTSTRAP_HEADER: prefill_url}
            prefill_call, prompt_sent = _send_prompt(client, prefill_url, body, headers)
            try:
                reply = await decode_reply(headers, prompt_sent)
            except httpx.HTTPError as exc:
                prefill_call.cancel()
                await _settle(prefill_call)
                return _unreachable("decode", decode_url, exc), False
            trace.mark("decode_headers")
            if reply.status_code == 200 and stream:
                return StreamingResponse(_pass_through(reply, prefill_call, trace),
                                         media_type="text/event-stream"), False
            content = await reply.aread()
            await reply.aclose()
            if reply.status_code != 200:
                # The decode side failed, maybe before it opened the room: hang up on the prefill server,
                # which then frees the prompt's KV it holds for the room at once, not at its deadline.
                prefill_call.cancel()
            await _settle(prefill_call)
            answer = Response(content, status_code=reply.status_code, media_type=reply.headers.get("content-type"))
            # Nothing reached the client yet: another prefill server may take a request this one refused.
            return answer, reply.status_code != 200 and _prefill_refused(content, prefill_call)

        return await offer(next_up(pick_prefill, len(prefill)), pick_prefill, len(prefill),
                           min(len(prefill), MAX_PREFILL_TRIES), prefill_try, trace, "prefill_retried")

    app.state.pool_loads = loads  # read by tests
    app.add_middleware(GiveBackPools, loads=loads)
    return app


def _send_prompt(client: httpx.AsyncClient, prefill_url: str, body: bytes,
                 headers: dict[str, str]) -> tuple[asyncio.Task, asyncio.Event]:
    """The prompt's call to the prefill server, as a task (it answers once the room is done or failed),
    and the event set once the prompt's body is written (or the call has ended)."""
    sent = asyncio.Event()
    call = asyncio.create_task(client.post(f"{prefill_url}/v1/chat/completions", content=_signalling(body, sent),
                                           headers={**headers, "content-length": str(len(body))}))
    call.add_done_callback(lambda _: sent.set())
    return call, sent


async def _open_decode(client: httpx.AsyncClient, decode_url: str, body: bytes, headers: dict[str, str],
                       prompt_sent: asyncio.Event, trace: Trace) -> httpx.Response:
    """The decode call, streamed, once the prompt's call has left whole. The prompt's call is the
    critical path; the decode call only opens the room, and has the prompt's compute time to do it.
    httpx writes a request's headers and its body in two writes with a yield between them: when both
    calls started at once, the decode call's headers went out in that yield and the prompt's body after
    them, so the prefill server's handler, started by the headers, waited for its body: 0.7-3.8 ms on
    the 2-core CPU (`bench.pd_ttft --phases`, "prefill: body read"), 0.1-1.3 ms since."""
    await prompt_sent.wait()
    trace.mark("prefill_sent")
    return await client.send(client.build_request("POST", f"{decode_url}/v1/chat/completions", content=body,
                                                  headers=headers), stream=True)


def _prefill_refused(decode_error: bytes, prefill_call: asyncio.Task) -> bool:
    """Whether a failed pair's request may go to another prefill server: the client has had nothing,
    and the prefill server kept nothing of it. So when it is shutting down (the decode side reports its
    503 `pd_prefill_stopping`), nothing listens there (the prompt's call could not connect), or the
    decode side could not reach it (502 `pd_prefill_unreachable`: its room was not opened, or its
    answer broke off, so no KV landed; the prompt's call, hung up by the caller, frees what the
    prefill server holds for it). The last happens in a rolling restart: a prompt sent over a kept-alive
    connection reaches a server whose listening socket closed before the decode side's room call."""
    if prefill_call.done() and not prefill_call.cancelled() and \
            isinstance(prefill_call.exception(), httpx.ConnectError):
        return True
    try:
        error = json.loads(decode_error).get("error")
    except (ValueError, AttributeError):
        return False
    return isinstance(error, dict) and error.get("code") in PREFILL_REFUSED_CODES


async def _signalling(body: bytes, sent: asyncio.Event) -> AsyncIterator[bytes]:
    """`body` as a request stream (its Content-Length set by the caller) that sets `sent` once the
    connection has written it: httpx asks for the next chunk only after the write."""
    yield body
    sent.set()


async def _pass_through(reply: httpx.Response, prefill_call: asyncio.Task,
                        trace: Trace = NO_TRACE) -> AsyncIterator[bytes]:
    try:
        async for chunk in reply.aiter_raw():
            if trace is not NO_TRACE and chunk.count(b'"content": "') > chunk.count(b'"content": ""'):
                trace.mark("first_token_relayed")  # the first chunk with text (the role chunk has none)
            yield chunk
    except httpx.HTTPError as exc:  # the decode server died mid-stream: say so inside the stream
        error = ApiError(502, f"decode server stream broke: {exc!r}", type="server_error", code="pd_stream_broken")
        yield f"data: {json.dumps(error.body())}\n\n".encode()
    finally:
        await reply.aclose()  # a client that went away closes the decode stream: its request is aborted
        await _settle(prefill_call)


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
    parser.add_argument("--upstream-pools", type=int, default=UPSTREAM_POOLS, metavar="N",
                        help="upstream connection pools a request's calls are spread over (httpx's pool costs "
                             "O(connections^2) per request: a few small pools keep a busy router's loop free)")
    parser.add_argument("--health-every", type=float, default=HEALTH_EVERY_S, metavar="S",
                        help="seconds between polls of each upstream's /health (a failing server is passed over)")
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    import uvicorn

    if args.upstream_pools < 1:
        parser.error(f"--upstream-pools must be at least 1, got {args.upstream_pools}")
    if not args.health_every > 0:
        parser.error(f"--health-every must be positive, got {args.health_every}")
    strip = [u.rstrip("/") for u in args.prefill], [u.rstrip("/") for u in args.decode]
    app = create_router_app(*strip, timeout_s=args.timeout, pools=args.upstream_pools,
                            health_every_s=args.health_every)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level.lower(), timeout_keep_alive=75)
    return 0


if __name__ == "__main__":
    sys.exit(main())
