"""The PD decode side gives a room up before its KV arrived (here: a first line it cannot use, an
error between the answer's two lines): its pages and receive slot go back only once the prefill
server has confirmed that no KV write into them is in progress or can start (`POST
/pd/rooms/{room}/close`). A prefill server that does not confirm in time (hangs, answers an error)
leaves them out of the pools for good, counted in /metrics; one that refuses the connection (nothing
listens: no writer) gets them back after a settle delay; a room the prefill side refused needs no
close. No transfer engine: a tiny engine, a real bridge, a host staging arena and a fake prefill
server (httpx.MockTransport)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import httpx
import pytest
import torch
from prometheus_client import CollectorRegistry

from runtime.config import EngineConfig
from runtime.disagg import decode as decode_module
from runtime.disagg.decode import DecodeSide
from runtime.disagg.metrics import PDMetrics
from runtime.disagg.protocol import BOOTSTRAP_HEADER, ROOM_HEADER
from runtime.disagg.staging import StagingArena
from runtime.engine.engine import Engine
from runtime.engine.request import SamplingParams
from runtime.env import Env
from runtime.faults import FaultSet
from runtime.server.bridge import EngineBridge
from runtime.server.metrics import ServerMetrics

pytestmark = pytest.mark.unit
PROMPT = [5, 6, 7, 8, 9, 10, 11]  # 2 pages of 4
PAGES = 2
TIMEOUT_S = 0.5  # the PD timeout of these decode sides
WRITE_S = 0.3  # how long a "slow" prefill side takes to confirm a close


class FakePrefill:
    """A prefill server's /pd routes: registration, a /pd/transfer answer whose first line lacks the
    sampler state (the decode side gives the room up on it) and whose second line never comes, and a
    close that answers `close` ("ok", "slow": after WRITE_S, "hang", an HTTP status, "refused", or
    "broken": the connection breaks), and `then` from its second call on when given."""

    def __init__(self, close: str | int = "ok", transfer_status: int = 200, then: str | int | None = None) -> None:
        self.close, self.transfer_status, self.then = close, transfer_status, then
        self.closes: list[dict] = []

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/pd/register":
            return httpx.Response(200, json={"session_id": "s-1", "version": 1})
        if path == "/pd/transfer":
            if self.transfer_status != 200:
                return httpx.Response(self.transfer_status, json={"error": {
                    "message": "room room-1: the prompt was aborted", "type": "server_error",
                    "code": "pd_transfer_failed"}})
            return httpx.Response(200, content=self._lines())
        assert path == "/pd/rooms/room-1/close", path
        self.closes.append(json.loads(request.content))
        close = self.close
        if len(self.closes) > 1 and self.then is not None:
            close = self.then
        if close == "broken":  # a pooled connection the server's death broke
            raise httpx.ReadError("", request=request)
        return await self._answer_close(close, request)

    async def _answer_close(self, close: str | int, request: httpx.Request) -> httpx.Response:
        if close == "refused":
            raise httpx.ConnectError("[Errno 111] Connection refused", request=request)
        if close == "hang":
            await asyncio.sleep(3600)
        if close == "slow":  # the prefill side waits out a write in progress
            await asyncio.sleep(WRITE_S)
        if isinstance(close, int):
            return httpx.Response(close, json={"error": {"message": "planted", "code": "pd_write_in_progress"}})
        return httpx.Response(200, json={"room": "room-1", "closed": True})

    async def _lines(self):
        yield b'{"first": {"token": 65}}\n'  # no num_sampled, no generator: `prefilled_request` fails
        await asyncio.sleep(3600)


@pytest.fixture
def decode(tiny):
    engine = Engine(tiny, EngineConfig(page_size=4, num_pages=64, prefix_cache=False), faults=FaultSet(),
                    env=Env(), overlap=False)
    bridge = EngineBridge(engine, ServerMetrics())
    arena = StagingArena(4 * StagingArena.ALIGN, pinned=False)
    transfer = SimpleNamespace(staging=arena, staged_bytes=lambda pages: pages * StagingArena.ALIGN,
                               latent=torch.zeros(1), descriptor=lambda: SimpleNamespace(to_dict=dict))
    metrics, registry = PDMetrics(), CollectorRegistry()
    metrics.attach(registry)
    side = DecodeSide(engine, transfer, "decode-test", metrics, TIMEOUT_S, FaultSet())  # type: ignore[arg-type]
    bridge.start()
    yield SimpleNamespace(engine=engine, bridge=bridge, arena=arena, side=side, state=SimpleNamespace(bridge=bridge),
                          registry=registry)
    bridge.stop()


async def give_up_a_room(decode, prefill: FakePrefill) -> None:
    """One request through `DecodeSide.start` against `prefill`, given up between the answer's lines."""
    side = decode.side
    side._client = (asyncio.get_running_loop(), httpx.AsyncClient(transport=httpx.MockTransport(prefill)))
    request = SimpleNamespace(headers={ROOM_HEADER: "room-1", BOOTSTRAP_HEADER: "http://prefill"})
    prepared = SimpleNamespace(prompt_ids=PROMPT, params=SamplingParams(max_tokens=8))
    with pytest.raises(Exception):  # noqa: B017 - whatever the client sees; what is left is the question
        await side.start(decode.state, request, "r1", prepared)


async def held(decode) -> tuple[int, int]:
    """Pages the request still owns and staging slots in use, once the engine thread applied what was
    queued."""
    await decode.bridge.call(lambda engine: None)
    return decode.engine.pool.pages_held("r1"), decode.arena.slots_in_use


async def closes_ended(side: DecodeSide) -> None:
    """Wait for the closes in flight (none on a decode side that sends none: the negative controls run
    these tests against the old one)."""
    await asyncio.gather(*getattr(side, "_closing", ()))


def metric(decode, name: str, **labels: str) -> float:
    return decode.registry.get_sample_value(name, labels) or 0.0


def test_the_pages_and_slot_go_back_once_the_prefill_side_confirmed_the_close(decode):
    """Negative control: the old decode side freed them at once (`before` was (0, 0)) and sent no close."""
    prefill = FakePrefill("slow")

    async def run() -> tuple[tuple[int, int], tuple[int, int]]:
        await give_up_a_room(decode, prefill)
        before = await held(decode)  # the close is on its way: nothing back yet
        await closes_ended(decode.side)
        return before, await held(decode)

    before, after = asyncio.run(run())
    assert before == (PAGES, 1) and after == (0, 0)
    assert [c["name"] for c in prefill.closes] == ["decode-test"]
    assert metric(decode, "dsv4_pd_room_closes_total", outcome="closed") == 1
    assert metric(decode, "dsv4_pd_pages_in_flight") == 0


@pytest.mark.parametrize("close", ["hang", 504, 404])
def test_an_unconfirmed_close_quarantines_the_pages_and_slot_within_the_deadline(decode, close):
    """The prefill server hangs past the PD timeout, or answers the close with an error (a write still
    in progress at its own deadline; a server without the route): the request's pages and receive slot
    stay out of the pools for good, /metrics counts them, and the close ends within the deadline.
    Negative control: the old decode side freed them at once."""
    prefill = FakePrefill(close)

    async def run() -> tuple[tuple[int, int], float]:
        loop = asyncio.get_running_loop()
        await give_up_a_room(decode, prefill)
        started = loop.time()
        await closes_ended(decode.side)
        return await held(decode), loop.time() - started

    left, took = asyncio.run(run())
    assert left == (PAGES, 1)
    assert took < TIMEOUT_S + 1.0
    assert metric(decode, "dsv4_pd_quarantined_pages") == PAGES
    assert metric(decode, "dsv4_pd_quarantined_staging_slots") == 1
    assert metric(decode, "dsv4_pd_room_closes_total", outcome="unconfirmed") == 1
    assert metric(decode, "dsv4_pd_pages_in_flight") == 0  # quarantined, not in flight


def test_a_refused_close_gives_the_pages_back_after_the_settle_delay(decode, monkeypatch):
    """Nothing listens at the prefill server's address (it died): no handler of the room, no writer
    left; what it put on the wire before it died lands within the settle delay, after which the pages
    and slot go back. Negative control: not waiting (REFUSED_SETTLE_S = 0) has them back sooner."""
    def freed_after(settle_s: float) -> float:
        monkeypatch.setattr(decode_module, "REFUSED_SETTLE_S", settle_s, raising=False)

        async def run() -> float:
            loop = asyncio.get_running_loop()
            await give_up_a_room(decode, FakePrefill("refused"))
            started = loop.time()
            await closes_ended(decode.side)
            assert await held(decode) == (0, 0)
            return loop.time() - started

        return asyncio.run(run())

    assert freed_after(0.3) >= 0.3
    assert freed_after(0.0) < 0.3
    assert metric(decode, "dsv4_pd_room_closes_total", outcome="refused") == 2
    assert metric(decode, "dsv4_pd_quarantined_pages") == 0


def test_a_room_the_prefill_side_refused_needs_no_close(decode):
    """/pd/transfer answered with a room error (the room failed there, its writes barred): the pages
    and slot go back at once, no close is sent."""
    prefill = FakePrefill(transfer_status=502)

    async def run() -> tuple[int, int]:
        await give_up_a_room(decode, prefill)
        assert not getattr(decode.side, "_closing", ())
        return await held(decode)

    assert asyncio.run(run()) == (0, 0) and prefill.closes == []


def test_shutdown_during_a_close_ends_at_once_and_frees_the_pages_and_slot(decode):
    """The server shuts down while a close hangs: `aclose` ends at once, not at the PD timeout, and
    frees the pages and the slot (the engine has stopped: nothing can be admitted into them)."""
    async def run() -> tuple[float, tuple[int, int]]:
        loop = asyncio.get_running_loop()
        await give_up_a_room(decode, FakePrefill("hang"))
        await asyncio.sleep(0.05)  # the close is in flight
        decode.bridge.stop()
        started = loop.time()
        await decode.side.aclose()
        return loop.time() - started, await held(decode)

    took, left = asyncio.run(run())
    assert took < TIMEOUT_S / 2 and left == (0, 0)
    assert metric(decode, "dsv4_pd_quarantined_pages") == 0


def test_a_close_whose_pooled_connection_broke_is_sent_again(decode):
    """The prefill server died: the close goes out on a pooled connection that breaks (ReadError), so
    it is sent once more, on a new connection, which is refused: the pages come back after the settle
    delay. Negative control: taking the broken connection for an unconfirmed close quarantined them
    (a killed prefill server's test found 2 pages held for good)."""
    prefill = FakePrefill("broken", then="refused")

    async def run() -> tuple[int, int]:
        await give_up_a_room(decode, prefill)
        await closes_ended(decode.side)
        return await held(decode)

    assert asyncio.run(run()) == (0, 0) and len(prefill.closes) == 2
    assert metric(decode, "dsv4_pd_room_closes_total", outcome="refused") == 1
