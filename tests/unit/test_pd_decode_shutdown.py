"""The PD decode side gives back every page and receive slot it reserved for a request when the server
shuts down, whatever phase the request is in: its KV landing still queued on the engine thread (the
check not started), or its page reservation still queued when the request was given up. And the engine
bridge, whose `call` carries those frees, still applies a call made after its engine thread stopped.
No transfer engine: a tiny engine, a real bridge and a host staging arena; tests/e2e/test_pd_shutdown.py
shuts a real decode server down with the digest computing or queued."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest
import torch

from runtime.config import EngineConfig
from runtime.disagg.decode import DecodeSide, RoomLink, prefilled_request
from runtime.disagg.metrics import PDMetrics
from runtime.disagg.protocol import BOOTSTRAP_HEADER, ROOM_HEADER
from runtime.disagg.staging import StagingArena
from runtime.engine.engine import Engine
from runtime.engine.request import SamplingParams
from runtime.env import Env
from runtime.faults import FaultSet
from runtime.server.bridge import EngineBridge
from runtime.server.metrics import ServerMetrics
from runtime.server.trace import NO_TRACE
from tests.unit.test_pd_first_token import prefill_reply

pytestmark = pytest.mark.unit
PROMPT = [5, 6, 7, 8, 9, 10, 11]  # 2 pages of 4


@pytest.fixture
def decode(tiny):
    """A started bridge over a tiny engine and a DecodeSide whose transfer is only a staging arena; the
    bridge is stopped at the end if the test did not."""
    engine = Engine(tiny, EngineConfig(page_size=4, num_pages=64, prefix_cache=False), faults=FaultSet(),
                    env=Env(), overlap=False)
    bridge = EngineBridge(engine, ServerMetrics())
    arena = StagingArena(4 * StagingArena.ALIGN, pinned=False)
    transfer = SimpleNamespace(staging=arena, staged_bytes=lambda pages: pages * StagingArena.ALIGN,
                               receive_staged=lambda offset, pages: None, latent=torch.zeros(1))
    side = DecodeSide(engine, transfer, "decode-test", PDMetrics(), 10.0, FaultSet())  # type: ignore[arg-type]
    bridge.start()
    yield SimpleNamespace(engine=engine, bridge=bridge, arena=arena, side=side, state=SimpleNamespace(bridge=bridge))
    bridge.stop()


def hold_engine_thread(bridge: EngineBridge) -> threading.Event:
    """Keep the engine thread busy in a call until the returned event is set (or the bridge stops): the
    commands queued meanwhile wait."""
    gate = threading.Event()

    def held(engine: Engine) -> None:
        while not gate.wait(0.01):
            if bridge._stop.is_set():
                return

    bridge.call(held)
    return gate


def test_a_call_after_the_engine_thread_stopped_runs_on_the_caller(decode):
    """Negative control for the old bridge: such a call was queued for a thread that was gone, and its
    future never settled (what a PD request freed at shutdown stayed held)."""
    async def run() -> list[int]:
        decode.bridge.stop()
        return await asyncio.wait_for(decode.bridge.call(lambda engine: engine.pool.allocate("late", 2)), 2)

    assert len(asyncio.run(run())) == 2 and decode.engine.pool.pages_held("late") == 2


def test_shutdown_with_the_kv_landing_queued_frees_the_pages_and_the_slot(decode):
    """The request's first token is out and its landing is queued behind a busy engine thread, so its
    check has not started, when the server shuts down (the app's lifespan: bridge stopped, then the PD
    side closed). Its receive slot is back when `aclose` returns, and its pages once the bridge has run
    the queued frees."""
    pool, side = decode.engine.pool, decode.side
    initial = pool.free_pages

    async def run() -> tuple[int, int]:
        staging = decode.arena.allocate(2 * StagingArena.ALIGN)
        pages = await decode.bridge.call(lambda engine: engine.pool.allocate("r1", 2))
        gate = hold_engine_thread(decode.bridge)
        req = prefilled_request("r1", PROMPT, SamplingParams(max_tokens=8), pages, prefill_reply(65))
        answer = Answered({**prefill_reply(65), "digest": "-", "kv_bytes": 0})
        decode.bridge.announce_prefilled("r1")
        side._spawn(side._verify_then_admit(decode.state, "room-1", req, answer, 0.0, staging,  # type: ignore[arg-type]
                                            asyncio.Queue(), NO_TRACE), side._verifying)
        await asyncio.sleep(0.05)
        assert answer.closed and decode.arena.slots_in_use == 1  # the KV's word is in, its landing queued
        decode.bridge.stop()
        await side.aclose()
        slots_at_close = decode.arena.slots_in_use
        gate.set()
        return slots_at_close, pool.free_pages

    assert asyncio.run(run()) == (0, initial)


class Answered:
    """A /pd/transfer answer whose result line is already in (TransferAnswer's two methods)."""

    def __init__(self, result: dict) -> None:
        self.result, self.closed = result, False
        self.link = RoomLink("http://127.0.0.1:9", "room-1")  # its last line is in: no write can land now

    async def line(self, want: str) -> dict:
        assert want == "done"
        return self.result

    async def aclose(self) -> None:
        self.closed = True


def test_a_request_given_up_while_its_pages_are_reserved_frees_them(decode):
    """The request is cancelled (server shutdown) while its page reservation waits in the engine
    thread's queue: the engine thread allocates anyway, and those pages come back."""
    pool, side = decode.engine.pool, decode.side
    initial = pool.free_pages
    request = SimpleNamespace(headers={ROOM_HEADER: "room-2", BOOTSTRAP_HEADER: "http://127.0.0.1:9"})
    prepared = SimpleNamespace(prompt_ids=PROMPT, params=SamplingParams(max_tokens=8))

    async def run() -> tuple[int, int]:
        gate = hold_engine_thread(decode.bridge)
        starting = asyncio.ensure_future(side.start(decode.state, request, "r2", prepared))
        await asyncio.sleep(0.05)  # its receive slot is reserved, its pages queued
        assert decode.arena.slots_in_use == 1
        starting.cancel()
        await asyncio.gather(starting, return_exceptions=True)
        gate.set()
        for _ in range(2):  # the reservation, then the free it left behind
            await decode.bridge.call(lambda engine: None)
        return decode.arena.slots_in_use, pool.free_pages

    assert asyncio.run(run()) == (0, initial)
