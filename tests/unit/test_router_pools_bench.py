"""bench.router_pools runs (no servers: in-memory upstreams) and shows what the router's pools are
for: with 160 streams open, one httpx pool costs the router several times the CPU per request of
sixteen (httpcore's quadratic pool walk; 31.4 vs 2.7 ms on the 2-core host). A ratio in one run, not
a time; marked `timing` so it runs alone after the parallel stage."""

from __future__ import annotations

import asyncio

import pytest

from bench.router_pools import run

pytestmark = pytest.mark.timing


def test_one_pool_costs_the_router_several_times_the_cpu_of_sixteen():
    one = asyncio.run(run(1, concurrency=160, requests=320, chunks=20, chunk_s=0.005))
    spread = asyncio.run(run(16, concurrency=160, requests=320, chunks=20, chunk_s=0.005))
    assert one["requests"] == spread["requests"] == 320
    assert spread["cpu_ms_per_request"] * 3 < one["cpu_ms_per_request"], (one, spread)
