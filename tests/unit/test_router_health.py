"""The PD router's health polls (runtime/router_health.py): a server failing its /health gets no new
request until it passes again, and the router's /health is 200 only while each role has a healthy
server, against in-memory upstreams (tests/fake_upstreams.py)."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from fastapi.testclient import TestClient

from runtime.router import create_router_app
from runtime.router_health import UpstreamHealth
from tests.fake_upstreams import FakeReply, FakeRequest, FakeUpstreams

pytestmark = pytest.mark.unit
BODY = {"model": "m", "stream": False, "messages": [{"role": "user", "content": "hi"}]}
PREFILL, DECODE_A, DECODE_B = "http://prefill:1", "http://decode-a:2", "http://decode-b:2"


def fleet(health: dict[str, int | None], every_s: float | None = 0.05):
    """A router over one prefill and two decode in-memory servers whose /health answers `health[host]`
    (None: nothing listens) and whose chat calls all succeed; returns (app, the decode hosts chat calls
    reached)."""
    served: list[str] = []

    def answer(request: FakeRequest) -> FakeReply:
        if request.path == "/health":
            status = health[request.host]
            return FakeReply.json(status, {"status": "ok" if status == 200 else "engine down"})
        if request.host != "prefill":
            served.append(request.host)
        return FakeReply.json(200, {"choices": []})

    fake = FakeUpstreams(answer, down={host for host, status in health.items() if status is None})
    app = create_router_app([PREFILL], [DECODE_A, DECODE_B], health_every_s=every_s, connect=fake.connect)
    return app, served


def test_a_server_failing_its_health_poll_gets_no_request_until_it_passes_again():
    """decode-a's engine is down (/health 503) but its chat route would still answer, so the request
    path alone never passes it over. Negative control: without polls it gets every other request."""
    health = {"prefill": 200, "decode-a": 503, "decode-b": 200}
    app, served = fleet(health)
    with TestClient(app) as router:
        for _ in range(6):
            assert router.post("/v1/chat/completions", content=json.dumps(BODY)).status_code == 200
        assert served == ["decode-b"] * 6
        health["decode-a"] = 200  # back: within a poll or two it is in the rotation again
        deadline = time.monotonic() + 5
        while "decode-a" not in served and time.monotonic() < deadline:
            router.post("/v1/chat/completions", content=json.dumps(BODY))
            time.sleep(0.02)
        assert "decode-a" in served
    unpolled, served = fleet(health | {"decode-a": 503}, every_s=None)
    with TestClient(unpolled) as router:
        for _ in range(6):
            router.post("/v1/chat/completions", content=json.dumps(BODY))
    assert served.count("decode-a") == 3


def test_the_router_health_is_ok_only_while_each_role_has_a_healthy_server():
    health = {"prefill": 200, "decode-a": None, "decode-b": 200}
    app, _ = fleet(health)
    with TestClient(app) as router:
        reply = router.get("/health")  # the first poll ran before the router served
        assert reply.status_code == 200 and reply.json()["status"] == "ok"
        upstreams = reply.json()["upstreams"]
        assert upstreams[DECODE_B]["healthy"] and not upstreams[DECODE_A]["healthy"]
        assert "unreachable: UpstreamConnectError: cannot connect to decode-a:2" in upstreams[DECODE_A]["reason"]
        metrics = router.get("/metrics").text
        assert f'dsv4_pd_upstream_up{{role="decode",url="{DECODE_A}"}} 0' in metrics
        assert f'dsv4_pd_upstream_up{{role="decode",url="{DECODE_B}"}} 1' in metrics
        health["decode-b"] = 503
        deadline = time.monotonic() + 5
        while router.get("/health").status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.02)
        reply = router.get("/health")
        assert reply.status_code == 503 and reply.json()["status"] == "no healthy decode server"
        assert reply.json()["upstreams"][DECODE_B]["reason"] == "/health answered 503"


def test_a_poll_that_hangs_counts_as_unhealthy_and_names_its_timeout():
    watch = UpstreamHealth({"prefill": ["p"], "decode": ["d"]}, every_s=1.0, timeout_s=0.05)

    async def check(url: str) -> int:
        if url == "d":
            await asyncio.sleep(10)
        return 200

    asyncio.run(watch.poll_once(check))
    assert watch.healthy("p") and not watch.healthy("d")
    assert "TimeoutError" in watch.upstreams["d"].reason
    assert watch.report()[0] == 503 and watch.unservable() == ["decode"]


def test_health_polling_refuses_bad_periods():
    with pytest.raises(ValueError, match="positive periods"):
        UpstreamHealth({"decode": ["d"]}, every_s=0)
    with pytest.raises(ValueError, match="positive periods"):
        UpstreamHealth({"decode": ["d"]}, timeout_s=-1)
