"""The PD prefill server's room opening waits for the engine's step in flight (runtime/disagg/after_step.py,
`EngineBridge.step_ended`): while a step runs the wait is not over; it ends once the step has ended and its tokens
reached their sinks (the first token's relay is written before the room's work); with no step running it is over at
once. The middleware holds only the room-opening path, and only on a prefill server with the knob on."""

from __future__ import annotations

import asyncio
import time

import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from runtime.config import EngineConfig
from runtime.disagg.after_step import ROOM_OPENING_PATHS, AfterTheStep
from runtime.engine.engine import Engine
from runtime.engine.request import SamplingParams
from runtime.env import Env
from runtime.faults import FaultSet
from runtime.server.bridge import Accepted, EngineBridge, TokenOut
from runtime.server.metrics import ServerMetrics

STEP_MS = 150.0  # the slow-step fault's delay: a step long enough to be caught running


@pytest.fixture
def slow_bridge(tiny):
    engine = Engine(tiny, EngineConfig(page_size=4, num_pages=64, prefix_cache=False),
                    faults=FaultSet(["slow-step"]), env=Env(slow_step_ms=STEP_MS), overlap=False)
    bridge = EngineBridge(engine, ServerMetrics())
    bridge.start()
    yield bridge
    bridge.stop()


async def _wait_until_stepping(bridge: EngineBridge, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not bridge._stepping:
        assert time.monotonic() < deadline, "the engine never started a step"
        await asyncio.sleep(0.001)


async def _tokens_before_the_wait_ends(bridge: EngineBridge) -> tuple[bool, bool, int]:
    """(the wait was over when asked, mid-step; it was over at once with no step running; TokenOut events in
    the request's sink at the moment the mid-step wait ended)."""
    sink = bridge.submit("r1", [5, 6, 7, 8, 9], SamplingParams(max_tokens=1))
    await _wait_until_stepping(bridge)
    ended = bridge.step_ended()
    done_when_asked = ended.done()
    await asyncio.wait_for(ended, 30)
    tokens = sum(isinstance(event, TokenOut) for event in list(sink._queue))  # type: ignore[attr-defined]
    events = [await sink.get() for _ in range(2)]
    assert isinstance(events[0], Accepted) and isinstance(events[1], TokenOut)
    deadline = time.monotonic() + 10
    while bridge._stepping or bridge.engine.has_work:  # the request ended: no step runs
        assert time.monotonic() < deadline
        await asyncio.sleep(0.005)
    return done_when_asked, bridge.step_ended().done(), tokens


def test_the_wait_ends_after_the_step_and_its_tokens_and_at_once_without_a_step(slow_bridge):
    done_when_asked, idle_done, tokens = asyncio.run(_tokens_before_the_wait_ends(slow_bridge))
    assert not done_when_asked, "the wait was over while the step still ran"
    assert tokens == 1, "the wait ended before the step's token reached its sink"
    assert idle_done, "with no step running the wait must be over at once"


def test_control_a_wait_that_does_not_wait_is_caught(slow_bridge, monkeypatch):
    """Negative control: `step_ended` planted to be done at once: the test above sees it done mid-step with no
    token in the sink."""
    def at_once() -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        future.set_result(None)
        return future
    monkeypatch.setattr(slow_bridge, "step_ended", at_once)
    done_when_asked, _, tokens = asyncio.run(_tokens_before_the_wait_ends(slow_bridge))
    assert done_when_asked and tokens == 0


def test_the_middleware_holds_the_room_opening_only_until_the_step_ends():
    seen: list[str] = []

    async def endpoint(request):
        seen.append(request.url.path)
        return PlainTextResponse("ok")

    gate: dict[str, asyncio.Future] = {}

    def step_ended() -> asyncio.Future:
        gate["future"] = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_later(0.2, gate["future"].set_result, None)
        return gate["future"]

    (path,) = ROOM_OPENING_PATHS
    app = Starlette(routes=[Route(path, endpoint, methods=["POST"]), Route("/health", endpoint)])
    with TestClient(AfterTheStep(app, paths=ROOM_OPENING_PATHS, step_ended=step_ended)) as client:
        started = time.monotonic()
        assert client.get("/health").text == "ok" and "future" not in gate, "another path waited for the step"
        assert client.post(path).text == "ok"
        assert gate["future"].done() and time.monotonic() - started >= 0.2, "the room opening did not wait"
    assert seen == ["/health", path]


@pytest.mark.parametrize("knob", [True, False])
def test_a_prefill_server_holds_room_openings_unless_the_knob_is_off(knob, tiny):
    from types import SimpleNamespace

    from runtime.server.app import ServerState, create_app

    engine = Engine(tiny, EngineConfig(page_size=4, num_pages=64, prefix_cache=False), faults=FaultSet(), env=Env(),
                    overlap=False)
    pd = SimpleNamespace(mode="prefill", metrics=SimpleNamespace(attach=lambda registry: None),
                         on_step=lambda result: None, add_routes=lambda app: None)
    state = ServerState(loaded=SimpleNamespace(name="tiny", weights_hash="0"), engine=engine,  # type: ignore[arg-type]
                        template=None, env=Env(pd_room_after_step=knob), pd=pd)  # type: ignore[arg-type]
    app = create_app(state)
    assert any(m.cls is AfterTheStep for m in app.user_middleware) is knob
    assert Env.load({"DSV4_PD_ROOM_AFTER_STEP": "0"}).pd_room_after_step is False
    assert Env().pd_room_after_step is True
