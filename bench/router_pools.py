"""The PD router's own cost per request with its upstream calls in one connection pool or spread over
several (runtime/router.py UPSTREAM_POOLS), on the 2-core CPU, no servers: the upstreams are in-memory
HTTP/1.1 connections (a prefill call answered at once, a decode call streaming `--chunks` SSE chunks
`--chunk-ms` apart), so `--concurrency` streams hold about twice as many upstream connections open at
once, as the 80-session PD gate's did.

    python -m bench.router_pools --pools 1,16 --concurrency 160 --requests 1600

Prints, per pool count, the wall time and the process CPU seconds per request (router + the in-process
client, the same client for every pool count).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import httpcore
import httpx

from runtime.router import create_router_app

BODY = json.dumps({"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}).encode()
CHUNK = b'data: {"choices": [{"index": 0, "delta": {"content": "x"}}]}\n\n'


class Upstreams(httpcore.AsyncNetworkBackend):
    def __init__(self, chunks: int, chunk_s: float) -> None:
        self.chunks, self.chunk_s = chunks, chunk_s

    async def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
        return UpstreamStream(host, self)


class UpstreamStream(httpcore.AsyncNetworkStream):
    """One keep-alive connection: each request's headers queue one answer; a decode answer is chunked
    and read piece by piece (one chunk per read, the sleep between reads)."""

    def __init__(self, host: str, upstreams: Upstreams) -> None:
        self.host, self.upstreams, self.pending = host, upstreams, []

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        if buffer.startswith(b"POST "):
            if self.host == "prefill":
                self.pending.append(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}")
            else:
                self.pending.append(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                                    b"transfer-encoding: chunked\r\n\r\n")
                for _ in range(self.upstreams.chunks):
                    self.pending.append(b"%x\r\n%s\r\n" % (len(CHUNK), CHUNK))
                self.pending.append(b"0\r\n\r\n")

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        if not self.pending:
            return b""
        piece = self.pending.pop(0)
        if not piece.startswith(b"HTTP/"):
            await asyncio.sleep(self.upstreams.chunk_s)
        return piece

    async def aclose(self) -> None:
        pass


async def run(pools: int, concurrency: int, requests: int, chunks: int, chunk_s: float) -> dict:
    upstreams = Upstreams(chunks, chunk_s)

    def client_on_upstreams(**kw) -> httpx.AsyncClient:
        client = httpx.AsyncClient(**kw)
        # httpx has no public hook for httpcore's network backend: the pool's is swapped for ours.
        client._transport._pool._network_backend = upstreams  # type: ignore[attr-defined]
        return client

    app = create_router_app(["http://prefill:1"], ["http://decode:2"], pools=pools, make_client=client_on_upstreams,
                            health_every_s=None)  # the in-memory upstreams answer chat calls only
    async with app.router.lifespan_context(app):  # builds the router's clients on the upstreams
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router",
                                     limits=limits, timeout=120) as client:
            gate = asyncio.Semaphore(concurrency)

            async def one() -> int:
                async with gate:
                    reply = await client.post("/v1/chat/completions", content=BODY)
                    return reply.status_code

            cpu, wall = time.process_time(), time.perf_counter()
            codes = await asyncio.gather(*(one() for _ in range(requests)))
            cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    if set(codes) != {200}:
        raise RuntimeError(f"pools={pools}: replies {sorted(set(codes))}")
    return dict(pools=pools, concurrency=concurrency, requests=requests, wall_s=round(wall, 3),
                cpu_ms_per_request=round(1000 * cpu / requests, 3))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.router_pools", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pools", default="1,16", help="pool counts to compare, comma-separated")
    parser.add_argument("--concurrency", type=int, default=160)
    parser.add_argument("--requests", type=int, default=1600)
    parser.add_argument("--chunks", type=int, default=20, help="SSE chunks a decode stream sends")
    parser.add_argument("--chunk-ms", type=float, default=5.0)
    parser.add_argument("--out", default=None, help="write the rows as JSON here too")
    args = parser.parse_args(argv)
    counts = [int(p) for p in args.pools.split(",")]
    if min(counts) < 1 or args.concurrency < 1 or args.requests < 1:
        parser.error("pools, concurrency and requests must be positive")
    rows = []
    for pools in counts:
        rows.append(asyncio.run(run(pools, args.concurrency, args.requests, args.chunks, args.chunk_ms / 1000)))
        print(json.dumps(rows[-1]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
