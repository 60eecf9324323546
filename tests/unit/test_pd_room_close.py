"""The PD decode side gives a room up before its KV arrived (here: a first line it cannot use, an
error between the answer's two lines): its pages and receive slot go back only once the prefill
server has confirmed that no KV write into them is in progress or can start (`POST
/pd/rooms/{room}/close`). A prefill server that does not confirm in time (hangs, answers an error)
quarantines them (out of the pools, counted in /metrics) while the close is retried, waiting longer each
time, until one is confirmed or refused; a prefill server without the close route (404) is named once
and keeps them until it is upgraded; shutdown stops the retries. One that refuses the connection
(nothing listens: no writer) gets them back after a settle delay; a room the prefill side refused
needs no close. No transfer engine: a tiny engine, a real bridge, a host staging arena and a fake prefill
server (tests/fake_upstreams.py's CannedUpstreams)."""

from __future__ import annotations

import asyncio
import json
from itertools import islice
from types import SimpleNamespace

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
from runtime.server.bridge import Accepted, EngineBridge, Failed
from runtime.server.errors import ApiError
from runtime.server.metrics import ServerMetrics
from runtime.upstream_http import UpstreamConnectError, UpstreamError
from tests.fake_upstreams import CannedUpstreams, FakeReply, FakeRequest

pytestmark = pytest.mark.unit
PROMPT = [5, 6, 7, 8, 9, 10, 11]  # 2 pages of 4
PAGES = 2
TIMEOUT_S = 0.5  # the PD timeout of these decode sides
WRITE_S = 0.3  # how long a "slow" prefill side takes to confirm a close


class FakePrefill:
    """A prefill server's /pd routes: registration, a /pd/transfer answer whose first line lacks the
    sampler state (the decode side gives the room up on it) and whose second line never comes, and a
    close that answers `close` ("ok", "slow": after WRITE_S, "hang", an HTTP status, "refused", or
    "broken": the connection breaks), and `then` from its second call on when given (a list: one answer
    per later call, its last one from then on). `closes` records each close's body, `closed_at` the
    loop's time of each."""

    def __init__(self, close: str | int = "ok", transfer_status: int = 200,
                 then: str | int | list[str | int] | None = None, offers_close: bool | None = None) -> None:
        self.close, self.transfer_status = close, transfer_status
        # Whether /pd/register offers the close route: not where the close answers 404 (an older server).
        self.offers_close = close != 404 if offers_close is None else offers_close
        self.then = [then] if isinstance(then, str | int) else then
        self.closes: list[dict] = []
        self.closed_at: list[float] = []

    async def __call__(self, request: FakeRequest) -> FakeReply:
        path = request.path
        if path == "/pd/register":
            return FakeReply.json(200, {"session_id": "s-1", "version": 1}
                                  | ({"room_close": True} if self.offers_close else {}))
        if path == "/pd/transfer":
            if self.transfer_status != 200:
                return FakeReply.json(self.transfer_status, {"error": {
                    "message": "room room-1: the prompt was aborted", "type": "server_error",
                    "code": "pd_transfer_failed"}})
            return FakeReply(chunks=self._lines())
        assert path.startswith("/pd/rooms/room-") and path.endswith("/close"), path
        self.closes.append(json.loads(request.body))
        self.closed_at.append(asyncio.get_running_loop().time())
        close = self.close
        if len(self.closes) > 1 and self.then:
            close = self.then[min(len(self.closes) - 2, len(self.then) - 1)]
        if close == "broken":  # a pooled connection the server's death broke
            raise UpstreamError("the upstream closed the connection mid-answer (0 bytes read)")
        return await self._answer_close(close)

    async def _answer_close(self, close: str | int) -> FakeReply:
        if close == "refused":
            raise UpstreamConnectError("cannot connect to prefill:80: ConnectionRefusedError(111)")
        if close == "hang":
            await asyncio.sleep(3600)
        if close == "slow":  # the prefill side waits out a write in progress
            await asyncio.sleep(WRITE_S)
        if isinstance(close, int):
            return FakeReply.json(close, {"error": {"message": "planted", "code": "pd_write_in_progress"}})
        return FakeReply.json(200, {"room": "room-1", "closed": True})

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


async def give_up_a_room(decode, prefill: FakePrefill, room: str = "room-1", rid: str = "r1",
                         url: str = "http://prefill") -> None:
    """One request `rid` through `DecodeSide.start` against `prefill` (at `url`), given up between the
    answer's lines: before its room opened (an error status), or after (the client's error on its sink,
    which the decode side opened with the room)."""
    side = decode.side
    side._client = (asyncio.get_running_loop(), CannedUpstreams(prefill))  # type: ignore[assignment]
    request = SimpleNamespace(headers={ROOM_HEADER: room, BOOTSTRAP_HEADER: url})
    prepared = SimpleNamespace(prompt_ids=PROMPT, params=SamplingParams(max_tokens=8))
    try:
        sink = await side.start(decode.state, request, rid, prepared)
    except ApiError:  # whatever the client sees; what is left is the question
        return
    assert isinstance(await sink.get(), Accepted)
    assert isinstance(await asyncio.wait_for(sink.get(), 10), Failed)


async def held(decode, rid: str = "r1") -> tuple[int, int]:
    """Pages request `rid` still owns and staging slots in use, once the engine thread applied what was
    queued."""
    await decode.bridge.call(lambda engine: None)
    return decode.engine.pool.pages_held(rid), decode.arena.slots_in_use


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
    are quarantined (out of the pools until a retried close is confirmed), /metrics counts them, and
    the first close ends within the deadline. Negative control: the old decode side freed them at once."""
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
    outcome = "no_route" if close == 404 else "unconfirmed"
    assert metric(decode, "dsv4_pd_room_closes_total", outcome=outcome) == 1
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


# ---- quarantined rooms: their close is retried ------------------------------------------------------

RETRY_MAX_S = 0.1  # the longest wait between retried closes in these tests (QUARANTINE_RETRY_MAX_S)


@pytest.fixture
def quick_retries(monkeypatch):
    """Retried closes within a fraction of a second (raising=False: the old decode side had none)."""
    monkeypatch.setattr(decode_module, "QUARANTINE_RETRY_FIRST_S", 0.02, raising=False)
    monkeypatch.setattr(decode_module, "QUARANTINE_RETRY_GROWTH", 2.0, raising=False)
    monkeypatch.setattr(decode_module, "QUARANTINE_RETRY_MAX_S", RETRY_MAX_S, raising=False)
    monkeypatch.setattr(decode_module, "REFUSED_SETTLE_S", 0.0)


def free_on(outcome: str, monkeypatch) -> None:
    """The planted bug: a close ending in `outcome` (which does not rule out a late write) frees."""
    monkeypatch.setattr(decode_module, "RELEASING_OUTCOMES", frozenset({"closed", "refused", outcome}),
                        raising=False)


async def quarantines_ended(side: DecodeSide) -> None:
    """Wait (5 s at most) for the retried closes of quarantined rooms (none on the old decode side)."""
    await asyncio.wait_for(asyncio.gather(*getattr(side, "_retrying", ())), 5)


async def closes_sent(prefill: FakePrefill, count: int) -> bool:
    """Whether `prefill` got `count` closes within 5 s."""
    for _ in range(500):
        if len(prefill.closes) >= count:
            return True
        await asyncio.sleep(0.01)
    return False


def test_retry_waits_grow_and_are_bounded():
    """2 s, doubling, up to 60 s, endless; a first wait over the bound is the bound; a server without
    the close route waits the longest at once, leaving the growing waits where they were."""
    retry_waits = decode_module.retry_waits
    assert list(islice(retry_waits(2.0, 2.0, 60.0), 8)) == [2, 4, 8, 16, 32, 60, 60, 60]
    assert list(islice(retry_waits(5.0, 3.0, 1.0), 2)) == [1, 1]
    waits = retry_waits(2.0, 2.0, 60.0)
    exact = lambda: 0.0  # noqa: E731  (no jitter)
    assert decode_module.next_retry_wait("no_route", waits, exact) == decode_module.QUARANTINE_RETRY_MAX_S
    assert decode_module.next_retry_wait("unconfirmed", waits, exact) == 2.0
    assert decode_module.next_retry_wait("unconfirmed", waits, lambda: 0.999) == pytest.approx(
        4.0 * (1 - decode_module.QUARANTINE_RETRY_JITTER), rel=1e-3)


def test_rooms_quarantined_together_do_not_retry_in_step():
    """One blip quarantines many rooms at once; their retried closes spread over the last quarter of
    each wait instead of reaching the prefill server together (the old waits were all equal)."""
    first = [decode_module.next_retry_wait("unconfirmed", decode_module.retry_waits(2.0, 2.0, 60.0))
             for _ in range(50)]
    assert all(1.5 <= w <= 2.0 for w in first)
    assert max(first) - min(first) > 0.2 and len(set(first)) == 50


def test_a_quarantined_room_goes_back_once_a_retried_close_is_confirmed(decode, quick_retries, caplog):
    """A prefill server that answered the close with errors (a write still in progress at its deadline,
    a pause) confirms it on the second retry: the pages and the slot go back, the gauges come down and
    the lift is counted and logged. Negative control: the old decode side kept them for good
    (`assert (2, 1) == (0, 0)`)."""
    prefill = FakePrefill(504, then=[504, "ok"])

    async def run() -> tuple[tuple[int, int], tuple[int, int]]:
        await give_up_a_room(decode, prefill)
        await closes_ended(decode.side)
        quarantined = await held(decode)
        await quarantines_ended(decode.side)
        return quarantined, await held(decode)

    quarantined, after = asyncio.run(run())
    assert quarantined == (PAGES, 1)
    assert after == (0, 0)
    assert len(prefill.closes) == 3 and {c["reason"] for c in prefill.closes} == {prefill.closes[0]["reason"]}
    assert metric(decode, "dsv4_pd_quarantined_pages") == 0
    assert metric(decode, "dsv4_pd_quarantined_staging_slots") == 0
    assert metric(decode, "dsv4_pd_quarantines_lifted_total", outcome="closed") == 1
    assert metric(decode, "dsv4_pd_pages_in_flight") == 0
    assert any("quarantine is lifted" in r.getMessage() and "retry 2" in r.getMessage() for r in caplog.records)


def test_a_retried_close_that_is_refused_frees_after_the_settle_delay(decode, quick_retries, monkeypatch):
    """The prefill server died after the first close went unanswered: the retry is refused, and the pages
    and slot go back once the settle delay passed. Negative control: the old decode side kept them."""
    monkeypatch.setattr(decode_module, "REFUSED_SETTLE_S", 0.2)
    prefill = FakePrefill(504, then="refused")

    async def run() -> tuple[tuple[int, int], float]:
        await give_up_a_room(decode, prefill)
        await closes_ended(decode.side)
        await quarantines_ended(decode.side)
        return await held(decode), asyncio.get_running_loop().time() - prefill.closed_at[-1]

    after, since_refused = asyncio.run(run())
    assert after == (0, 0) and since_refused >= 0.2
    assert metric(decode, "dsv4_pd_quarantines_lifted_total", outcome="refused") == 1
    assert metric(decode, "dsv4_pd_quarantined_pages") == 0


def unconfirmed_retries_violations(decode) -> list[str]:
    """What is wrong while a prefill server keeps answering the close with an error (3 retries, then
    shutdown mid-retry): the pages or slot back, the gauges down, retries that did not stop at shutdown,
    a shutdown that waited for a retry in flight, an error logged by asyncio."""
    prefill, found = FakePrefill(504, then=[504, 504, 504, "hang"]), []
    decode.side.timeout_s = 3600  # a hanging retry ends only by shutdown

    async def quarantined() -> bool:
        return await held(decode) == (PAGES, 1) and metric(decode, "dsv4_pd_quarantined_pages") == PAGES

    async def run() -> None:
        await give_up_a_room(decode, prefill)
        await closes_ended(decode.side)
        for sent in (1, 5):  # the first close, then 3 retries answered 504 and 1 hanging
            if not await closes_sent(prefill, sent):
                found.append(f"{len(prefill.closes)} closes sent, {sent} awaited")
            if not await quarantined():
                found.append(f"freed on an unconfirmed close: {await held(decode)} held")
                return
        decode.bridge.stop()
        try:
            await asyncio.wait_for(decode.side.aclose(), 5)
        except TimeoutError:
            found.append("shutdown waited for the retried close")
        sent = len(prefill.closes)
        await asyncio.sleep(3 * RETRY_MAX_S)
        if [t for t in asyncio.all_tasks() if t.get_coro().__name__ == "_retry_quarantined"]:  # type: ignore[union-attr]
            found.append("a retried close still runs after shutdown")
        if len(prefill.closes) != sent:
            found.append(f"{len(prefill.closes) - sent} closes sent after shutdown")
        if await held(decode) != (PAGES, 1) or metric(decode, "dsv4_pd_quarantined_staging_slots") != 1:
            found.append(f"shutdown freed the quarantined room: {await held(decode)} held")

    asyncio.run(run())
    return found


def free_on_unconfirmed(decode, monkeypatch) -> None:
    free_on("unconfirmed", monkeypatch)


def retries_outlive_shutdown(decode, monkeypatch) -> None:
    """The planted bug: `aclose` leaves the retried closes running."""
    cancel = decode_module._cancel_and_wait

    async def all_but_the_retries(tasks: set[asyncio.Task]) -> None:
        if tasks is not getattr(decode.side, "_retrying", None):
            await cancel(tasks)

    monkeypatch.setattr(decode_module, "_cancel_and_wait", all_but_the_retries)


@pytest.mark.parametrize("planted, caught", [(None, None), (free_on_unconfirmed, "freed on an unconfirmed close"),
                                             (retries_outlive_shutdown, "a retried close still runs")],
                         ids=["as_built", "free_on_unconfirmed", "retries_outlive_shutdown"])
def test_unconfirmed_retries_keep_the_pages_and_shutdown_stops_them(decode, quick_retries, monkeypatch, caplog,
                                                                    planted, caught):
    """Retried closes answered with an error keep the pages and slot quarantined; shutdown during a
    retry in flight ends without waiting for it, stops every retry, frees nothing and logs no error of
    its own. Negative controls: the old decode side never retried (`['1 closes sent, 5 awaited']`); a
    planted free on "unconfirmed" and retries left running by `aclose` are caught."""
    if planted is not None:
        planted(decode, monkeypatch)
    found = unconfirmed_retries_violations(decode)
    if planted is None:
        assert found == []
        assert not [r for r in caplog.records if r.name == "asyncio"]
        assert metric(decode, "dsv4_pd_quarantines_lifted_total", outcome="closed") == 0
    else:
        assert any(f.startswith(caught) for f in found), found


def no_route_violations(decode, caplog) -> list[str]:
    """What is wrong when two prefill servers without the close route (404) get given-up rooms (two on
    one, one on the other), then are upgraded: not one upgrade line per server, a room freed before the
    upgrade, a room still held after it."""
    decode.arena = decode.side.transfer.staging = StagingArena(8 * StagingArena.ALIGN, pinned=False)
    prefill, found = FakePrefill(404), []
    rooms = [("room-1", "r1", "http://old-a"), ("room-2", "r2", "http://old-a"), ("room-3", "r3", "http://old-b")]

    async def run() -> None:
        for room, rid, url in rooms:
            await give_up_a_room(decode, prefill, room, rid, url)
        await closes_ended(decode.side)
        upgrade = [r.getMessage() for r in caplog.records if "has no room-close route" in r.getMessage()]
        if len(upgrade) != 2 or not all("upgrade it" in line for line in upgrade):
            found.append(f"upgrade lines: {upgrade}")
        if [await held(decode, rid) for _, rid, _ in rooms] != [(PAGES, 3)] * 3:
            found.append(f"freed without a confirmed close: {[await held(decode, rid) for _, rid, _ in rooms]}")
        prefill.close = "ok"  # upgraded
        await quarantines_ended(decode.side)
        if [await held(decode, rid) for _, rid, _ in rooms] != [(0, 0)] * 3:
            found.append("still quarantined after the upgrade")

    asyncio.run(run())
    return found


@pytest.mark.parametrize("planted", [None, "no_route"], ids=["as_built", "free_on_no_route"])
def test_a_prefill_server_without_the_close_route_is_named_once_and_its_rooms_wait_for_its_upgrade(
        decode, quick_retries, monkeypatch, caplog, planted):
    """A prefill server older than the close route answers it 404: nothing rules out a late write, so
    the rooms stay quarantined; one log line per server names it and says to upgrade it; once it is
    upgraded, the retried closes are confirmed and every page and slot goes back. Negative controls:
    the old decode side logged no such line and kept the pages for good; a planted free on "no_route"
    is caught."""
    if planted is not None:
        free_on(planted, monkeypatch)
    found = no_route_violations(decode, caplog)
    if planted is None:
        assert found == []
        assert metric(decode, "dsv4_pd_room_closes_total", outcome="no_route") == 3
        assert metric(decode, "dsv4_pd_quarantines_lifted_total", outcome="closed") == 3
        assert metric(decode, "dsv4_pd_quarantined_pages") == 0
    else:
        assert any(f.startswith("freed without a confirmed close") for f in found), found


@pytest.mark.parametrize("offers", [True, False])
def test_a_prefill_server_without_the_close_route_is_named_when_it_registers(decode, caplog, offers):
    """A prefill server's /pd/register answer says whether it confirms room closes: one that does not
    (an older version) is named at registration, before any room is given up there, where it costs
    quarantined pages; one that does is not. Negative control: named only at its first 404 before."""
    async def run() -> None:
        client = CannedUpstreams(FakePrefill(offers_close=offers))
        assert await decode.side._session(client, "http://prefill") == "s-1"  # type: ignore[arg-type]

    asyncio.run(run())
    named = [r.getMessage() for r in caplog.records if "has no room-close route" in r.getMessage()]
    if offers:
        assert named == []
    else:
        assert len(named) == 1 and "http://prefill" in named[0] and "does not offer one" in named[0]
