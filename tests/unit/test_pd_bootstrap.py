"""runtime/disagg/bootstrap.py: sessions are versioned per decode name, a stale session is refused
with a clear error, a re-registration fails the old session's rooms at once, and every wait ends in
a timeout error instead of a hang. The pd-stale-bootstrap fault is the negative control."""

from __future__ import annotations

import asyncio

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
