"""runtime/disagg/bootstrap.py: sessions are versioned per decode name, a stale session is refused
with a clear error, a re-registration fails the old session's rooms at once, and every wait ends in
a timeout error instead of a hang. The pd-stale-bootstrap fault is the negative control."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from runtime.disagg.bootstrap import BootstrapRegistry, BootstrapTimeout, RoomFailed, StaleSessionError
from runtime.disagg.transfer import PoolDescriptor
from runtime.faults import FaultSet

pytestmark = pytest.mark.unit


def pool(port: int) -> PoolDescriptor:
    return PoolDescriptor(f"127.0.0.1:{port}", 4096, 8192, 2, 64, 12, 4, 4, 8)


def run(coro):
    return asyncio.run(coro)


def restarted_session_is_fresh(faults: FaultSet) -> bool:
    """The oracle: after a restart under the same name, the old session id is refused and the new
    session points at the new process's pool."""
    registry = BootstrapRegistry(faults)
    old = registry.register("decode-0", "life-1", pool(1000))
    new = registry.register("decode-0", "life-2", pool(2000))
    try:
        registry.current("decode-0", old.session_id)
    except StaleSessionError:
        return new.version == old.version + 1 and new.pool.session == "127.0.0.1:2000"
    return False


def test_a_restarted_decode_server_gets_a_fresh_session():
    assert restarted_session_is_fresh(FaultSet())


def test_stale_bootstrap_fault_is_caught():
    assert not restarted_session_is_fresh(FaultSet(["pd-stale-bootstrap"]))


def test_stale_and_unknown_sessions_are_refused_by_name():
    async def scenario():
        registry = BootstrapRegistry()
        old = registry.register("decode-0", "life-1", pool(1000))
        registry.register("decode-0", "life-2", pool(2000))
        with pytest.raises(StaleSessionError, match="stale.*register again"):
            registry.open("room-1", "decode-0", old.session_id, [0])
        with pytest.raises(StaleSessionError, match="no session here"):
            registry.open("room-2", "decode-9", old.session_id, [0])

    run(scenario())


def test_rooms_meet_and_complete():
    async def scenario():
        registry = BootstrapRegistry()
        session = registry.register("decode-0", "life-1", pool(1000))
        prefill = asyncio.create_task(registry.wait_opened("room-1", 5))
        await asyncio.sleep(0)
        registry.open("room-1", "decode-0", session.session_id, [3, 4])
        room = await prefill
        assert room.dst_pages == [3, 4] and room.session == session
        decode = asyncio.create_task(registry.wait_done("room-1", 5))
        await asyncio.sleep(0)
        registry.complete("room-1", {"token": 7})
        assert await decode == {"token": 7}
        assert registry.open_rooms == 0

    run(scenario())


def test_every_wait_times_out_with_an_error():
    async def scenario():
        registry = BootstrapRegistry()
        with pytest.raises(BootstrapTimeout, match="no decode server opened room room-1 within 0.05 s"):
            await registry.wait_opened("room-1", 0.05)
        session = registry.register("decode-0", "life-1", pool(1000))
        registry.open("room-2", "decode-0", session.session_id, [0])
        with pytest.raises(BootstrapTimeout, match="did not deliver the KV"):
            await registry.wait_done("room-2", 0.05)
        assert registry.open_rooms == 0

    run(scenario())


def test_re_registration_fails_the_old_sessions_rooms_at_once():
    async def scenario():
        registry = BootstrapRegistry()
        old = registry.register("decode-0", "life-1", pool(1000))
        registry.open("room-1", "decode-0", old.session_id, [0])
        waiter = asyncio.create_task(registry.wait_done("room-1", 30))
        await asyncio.sleep(0)
        registry.register("decode-0", "life-2", pool(2000))
        with pytest.raises(StaleSessionError, match="re-registered"):
            await asyncio.wait_for(waiter, 1)

    run(scenario())


def test_the_same_process_registering_twice_keeps_its_session():
    """Concurrent first requests of one decode server each register: that must not look like a restart."""
    async def scenario():
        registry = BootstrapRegistry()
        first = registry.register("decode-0", "life-1", pool(1000))
        registry.open("room-1", "decode-0", first.session_id, [0])
        again = registry.register("decode-0", "life-1", pool(1000))
        assert again == first and registry.open_rooms == 1

    run(scenario())


def test_a_failed_room_bars_later_writes():
    """Once a room has failed (and the decode side may free its pages), the writer finds it closed."""
    async def scenario():
        registry = BootstrapRegistry()
        session = registry.register("decode-0", "life-1", pool(1000))
        room = registry.open("room-1", "decode-0", session.session_id, [0])
        with pytest.raises(BootstrapTimeout):
            await registry.wait_done("room-1", 0.01)
        with room.lock:
            assert room.closed

    run(scenario())


def test_a_room_given_up_before_it_opened_refuses_a_late_open_at_once_then_is_forgotten():
    """The prefill side gave the room up (deadline, caller gone) before the decode side opened it: the
    late open fails at once with that error (its pages are freed now, not at its own deadline), and
    the record of it does not outlive `forget_s`."""
    async def scenario():
        registry = BootstrapRegistry(forget_s=0.05)
        session = registry.register("decode-0", "life-1", pool(1000))
        with pytest.raises(BootstrapTimeout):
            await registry.wait_opened("room-1", 0.01)
        with pytest.raises(BootstrapTimeout, match="no decode server opened room room-1"):
            registry.open("room-1", "decode-0", session.session_id, [0])
        registry.expect("room-2")
        registry.fail("room-2", RoomFailed("room room-2: the prefill server's caller went away"))
        await asyncio.sleep(0.1)
        assert registry._opened == {} and registry.open_rooms == 0
        registry.open("room-2", "decode-0", session.session_id, [0])  # forgotten: an ordinary room again
        assert registry.open_rooms == 1

    run(scenario())


# ---- a failure that meets a KV write in progress; the decode side's close ----------------------------

WRITE_S = 0.3  # how long the planted write holds its room's lock


def write_in_progress(room) -> threading.Event:
    """A writer thread holding `room.lock` for WRITE_S, as `PrefillSide._write` holds it while Mooncake
    writes; the returned event is set once it holds it."""
    holding = threading.Event()

    def write() -> None:
        with room.lock:
            holding.set()
            time.sleep(WRITE_S)

    threading.Thread(target=write, daemon=True).start()
    assert holding.wait(5)
    return holding


def opened(registry: BootstrapRegistry, room: str = "room-1"):
    session = registry.register("decode-0", "life-1", pool(1000))
    return registry.open(room, "decode-0", session.session_id, [0])


def test_a_failure_during_a_write_does_not_block_the_loop_and_fails_the_room_once_the_write_ended():
    """`fail` meets a write in progress (the prefill server's caller or the decode side went away):
    it returns at once, the event loop serving every other room meanwhile, and the room's waiters
    (the decode side's error line, on which it frees the pages) hear of the failure only once the
    write ended, with later writes barred. Negative control: the old `fail` waited for the room's lock
    on the event loop (the call took the whole write)."""
    async def scenario() -> tuple[float, bool, float, bool]:
        registry = BootstrapRegistry()
        room = opened(registry)
        write_in_progress(room)
        loop = asyncio.get_running_loop()
        started = loop.time()
        registry.fail("room-1", RoomFailed("room room-1: the decode side stopped waiting"))
        returned = loop.time() - started
        failed_during_write = room.done.done()
        with pytest.raises(RoomFailed):
            await asyncio.wait_for(asyncio.shield(room.done), 5)
        return returned, failed_during_write, loop.time() - started, room.closed

    returned, failed_during_write, failed_after, closed = run(scenario())
    assert returned < WRITE_S / 3, f"fail blocked the event loop for {returned:.3f} s"
    assert not failed_during_write and failed_after >= WRITE_S * 0.9 and closed


def test_a_timed_out_wait_for_the_kv_answers_only_once_the_write_in_progress_ended():
    """wait_done's deadline meets a write in progress: its timeout error (the decode side's error line,
    on which it frees the pages) comes only once the write ended. Negative control: raising as soon as
    `fail` returned (the deferred failure not awaited) answers during the write."""
    async def scenario(await_the_write: bool) -> float:
        registry = BootstrapRegistry()
        room = opened(registry)
        write_in_progress(room)
        loop = asyncio.get_running_loop()
        started = loop.time()
        if not await_the_write:  # the planted bug
            registry.fail("room-1", BootstrapTimeout("room room-1: deadline"))
            return loop.time() - started
        with pytest.raises(BootstrapTimeout):
            await registry.wait_done("room-1", 0.01)
        return loop.time() - started

    assert run(scenario(True)) >= WRITE_S * 0.9
    assert run(scenario(False)) < WRITE_S / 3


def test_closing_a_room_answers_once_its_write_ended_without_blocking_the_loop():
    """The decode side's close meets a write in progress: `close_room` returns True only once the
    write ended (then the room is closed and failed), while the event loop keeps running."""
    async def scenario() -> tuple[bool, float, int, bool]:
        registry = BootstrapRegistry()
        room = opened(registry)
        write_in_progress(room)
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.01)

        ticker = asyncio.ensure_future(tick())
        loop = asyncio.get_running_loop()
        started = loop.time()
        closed = await registry.close_room("room-1", RoomFailed("room room-1: given up"), 5.0)
        ticker.cancel()
        with pytest.raises(RoomFailed):
            room.done.result()
        return closed, loop.time() - started, ticks, room.closed

    closed, took, ticks, barred = run(scenario())
    assert closed and barred and took >= WRITE_S * 0.9
    assert ticks >= 10, f"the event loop ran {ticks} times in {took:.2f} s"


def test_closing_a_room_whose_write_outlasts_the_deadline_is_not_confirmed():
    async def scenario() -> tuple[bool, bool]:
        registry = BootstrapRegistry()
        room = opened(registry)
        write_in_progress(room)
        return await registry.close_room("room-1", RoomFailed("room room-1: given up"), 0.05), room.done.done()

    assert run(scenario()) == (False, False)


def test_closing_a_room_before_it_opened_or_its_request_arrived_refuses_the_late_open():
    """The decode side closes a room its prefill server has not opened yet (its /pd/transfer call is
    still on its way), or has not even heard of (the prompt not arrived): the late open fails, and so
    does the prompt's wait for the room, at once."""
    async def scenario() -> None:
        registry = BootstrapRegistry()
        session = registry.register("decode-0", "life-1", pool(1000))
        registry.expect("room-1")
        for room in ("room-1", "room-2"):  # arrived / not arrived yet
            assert await registry.close_room(room, RoomFailed(f"room {room}: given up"), 1.0)
            registry.expect(room)
            with pytest.raises(RoomFailed, match="given up"):
                await registry.wait_opened(room, 5.0)
            with pytest.raises(RoomFailed, match="given up"):
                registry.open(room, "decode-0", session.session_id, [0])
        assert registry.open_rooms == 0

    run(scenario())


def test_a_close_after_the_room_failed_and_was_forgotten_still_waits_for_the_write():
    """The decode side hung up (its wait_done cancelled: the room failed, then forgotten) while the
    write was in progress; its close arrives after that: it still waits for the write, not only for
    the rooms the registry still lists."""
    async def scenario() -> tuple[bool, float]:
        registry = BootstrapRegistry()
        room = opened(registry)
        write_in_progress(room)
        waiting = asyncio.ensure_future(registry.wait_done("room-1", 5.0))
        await asyncio.sleep(0.01)
        waiting.cancel()  # the decode side's connection went away
        await asyncio.gather(waiting, return_exceptions=True)
        assert registry.open_rooms == 0  # forgotten
        loop = asyncio.get_running_loop()
        started = loop.time()
        closed = await registry.close_room("room-1", RoomFailed("room room-1: given up"), 5.0)
        return closed, loop.time() - started

    closed, took = run(scenario())
    assert closed and took >= WRITE_S * 0.5


def test_draining_opens_no_room_lets_open_rooms_finish_and_ends_with_no_write_in_progress():
    """A graceful shutdown's `drain`, before the server stops listening: a new open is refused by name
    (503 pd_prefill_stopping), a room that completes within the wait completes normally, and a room
    whose write is in progress at the wait's end is failed once that write ended: when `drain`
    returns, no write is in progress and none can start. Negative control: the old shutdown had no
    such step (the decode side's close then found nothing listening while the write ran)."""
    from runtime.disagg.protocol import PrefillStopping, api_error

    async def scenario() -> dict:
        registry = BootstrapRegistry()
        finishing, writing = opened(registry, "room-1"), opened(registry, "room-2")
        holding = write_in_progress(writing)
        assert holding.wait(5)
        loop = asyncio.get_running_loop()
        loop.call_later(0.05, registry.complete, "room-1", {"digest": "d"})
        loop.call_later(0.1, registry.close, "room-1")  # its /pd/transfer answer went out
        started = loop.time()
        stuck = await registry.drain(wait_s=0.15, write_timeout_s=5.0)
        took = loop.time() - started
        session = registry.sessions["decode-0"]
        with pytest.raises(PrefillStopping) as refused:
            registry.open("room-3", "decode-0", session.session_id, [1])
        return {"stuck": stuck, "took": took, "finished": finishing.done.result(), "barred": writing.closed,
                "failed": type(writing.done.exception()), "refused": api_error(refused.value).status}

    out = run(scenario())
    assert out["stuck"] == [] and out["took"] >= WRITE_S * 0.9
    assert out["finished"] == {"digest": "d"} and out["barred"] and out["failed"] is PrefillStopping
    assert out["refused"] == 503


def test_draining_names_a_room_whose_write_outlasts_its_deadline():
    async def scenario() -> list[str]:
        registry = BootstrapRegistry()
        assert write_in_progress(opened(registry)).wait(5)
        return await registry.drain(wait_s=0.0, write_timeout_s=0.05)

    assert run(scenario()) == ["room-1"]
