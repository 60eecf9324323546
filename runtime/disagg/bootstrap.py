"""`BootstrapRegistry`: the prefill side's table of decode sessions and per-request rooms.

A decode server registers its KV pool (`PoolDescriptor`) under its name and gets a session: an id
and a version that grows with every registration of that name. A restarted decode server registers
again, so the session it had before is replaced and any room opened under the old id is refused with
`StaleSessionError` (never written into a dead process's memory, never waited on forever).

A room is one request's meeting point: the router gives the prefill and the decode server the same
room id; the decode side opens it with its destination page ids and long-polls for the result, the
prefill side runs the prompt meanwhile (holding its KV pages), hands the prompt's first token over as
soon as it has it (`prefilled`: the decode side sends it to its client before the KV arrives), waits
for the room to be opened, writes the KV and completes it. Every wait has a deadline that becomes
`BootstrapTimeout`, an error the client sees. A room that fails before it is opened (the prefill side
timed out or gave up) stays failed for `forget_s`, so a late open is refused at once instead of
waiting out its own deadline. A decode side that gives a room up before its KV arrived closes it
(`close_room`): the room fails once no write into its pages is in progress, before the decode side
frees them. A prefill server shutting down drains (`drain`) before it stops listening: a decode side
that then finds nothing listening ("connection refused") knows no write of it is still in progress.

All methods run on the prefill server's event loop (the engine thread completes rooms through
`loop.call_soon_threadsafe`).
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from dataclasses import dataclass, field

from runtime.disagg.protocol import BootstrapError, BootstrapTimeout, PrefillStopping, RoomFailed, StaleSessionError
from runtime.disagg.transfer import PoolDescriptor
from runtime.faults import NO_FAULTS, FaultSet

DRAIN_POLL_S = 0.02  # how often `drain` looks whether the open rooms have finished


@dataclass(frozen=True)
class Session:
    name: str  # the decode server's stable name (its URL by default)
    instance: str  # the decode process's id: a new one means the server restarted
    session_id: str
    version: int
    pool: PoolDescriptor


@dataclass
class Room:
    room: str
    session: Session
    dst_pages: list[int]
    done: asyncio.Future = field(repr=False)
    staging_offset: int | None = None  # staged transfer: the decode side's receive slot for this room
    # Held by the writer thread while it writes into dst_pages; `closed` is set under it when the room
    # fails, so once the decode side hears of a failure (and frees the pages) no write can still land.
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    closed: bool = False
    # A failure that met a write in progress: it waits that write out off the event loop (`fail`).
    barring: asyncio.Task | None = field(default=None, repr=False)


class BootstrapRegistry:
    def __init__(self, faults: FaultSet = NO_FAULTS, forget_s: float = 120.0) -> None:
        self.faults = faults
        self.forget_s = forget_s  # how long a room that failed before it was opened refuses a late open
        self.sessions: dict[str, Session] = {}  # by decode name: the current session only
        self.rooms: dict[str, Room] = {}
        self._opened: dict[str, asyncio.Future] = {}  # room id -> resolves with the Room once opened
        # room id -> resolves with the prompt's outcome (first token, sampler state) once it finished
        self._first: dict[str, asyncio.Future] = {}
        # Failed rooms whose failure waits for a write in progress (`fail`), kept here until it ended even
        # once `close` forgot them: the decode side's close must still find and wait for that write.
        self._writing: dict[str, Room] = {}
        self.stopping = False  # set by `drain`: no room opens any more

    # ---- sessions -------------------------------------------------------------------------------
    def register(self, name: str, instance: str, pool: PoolDescriptor) -> Session:
        """The session of decode server `name` as process `instance`: the current one again when the same
        process registers twice (concurrent first requests), a new version when the process is new."""
        old = self.sessions.get(name)
        if old is not None and (old.instance == instance or self.faults.enabled("pd-stale-bootstrap")):
            # (the fault: a restarted decode server is handed its previous life's session state)
            return old
        session = Session(name, instance, uuid.uuid4().hex, (old.version + 1) if old else 1, pool)
        self.sessions[name] = session
        if old is not None:  # rooms of the dead process can never complete: fail them now
            for room in [r for r in self.rooms.values() if r.session.session_id == old.session_id]:
                self.fail(room.room, StaleSessionError(f"decode server {name!r} re-registered (session "
                                                       f"v{old.version} -> v{session.version}) while room "
                                                       f"{room.room} was in flight"))
        return session

    def current(self, name: str, session_id: str) -> Session:
        session = self.sessions.get(name)
        if session is None:
            raise StaleSessionError(f"decode server {name!r} has no session here (the prefill server restarted?): "
                                    f"register again")
        if session.session_id != session_id:
            raise StaleSessionError(f"session {session_id} of decode server {name!r} is stale: the current one "
                                    f"is v{session.version}; register again")
        return session

    # ---- rooms ----------------------------------------------------------------------------------
    def _opened_future(self, room: str) -> asyncio.Future:
        return self._opened.setdefault(room, asyncio.get_running_loop().create_future())

    def _first_future(self, room: str) -> asyncio.Future:
        return self._first.setdefault(room, asyncio.get_running_loop().create_future())

    def expect(self, room: str) -> None:
        """Prefill side: a request for `room` has arrived (before its room is opened): from now on a
        failure of the room (`fail`) is kept for its decode side's open, and for `wait_opened`."""
        self._opened_future(room)
        self._first_future(room)

    def prefilled(self, room: str, outcome: dict) -> None:
        """Prefill side: the prompt finished with `outcome` (its first token and sampler state); its KV
        is not written yet."""
        first = self._first.get(room)
        if first is not None and not first.done():
            first.set_result(outcome)

    def open(self, room: str, name: str, session_id: str, dst_pages: list[int],
             staging_offset: int | None = None) -> Room:
        if self.stopping:
            raise PrefillStopping(room)
        session = self.current(name, session_id)
        if room in self.rooms:
            raise BootstrapError(f"room {room} is already open")
        given_up = self._opened.get(room)
        error = given_up.exception() if given_up is not None and given_up.done() else None
        if error is not None:  # the prefill side gave the room up before it was opened
            del self._opened[room]
            raise error
        entry = Room(room, session, list(dst_pages), asyncio.get_running_loop().create_future(), staging_offset)
        self.rooms[room] = entry
        opened = self._opened_future(room)
        if not opened.done():
            opened.set_result(entry)
        return entry

    async def wait_opened(self, room: str, timeout_s: float) -> Room:
        """Prefill side: the room once its decode server has opened it."""
        opened = self._opened_future(room)
        try:
            return await asyncio.wait_for(asyncio.shield(opened), timeout_s)
        except TimeoutError:
            error = BootstrapTimeout(f"no decode server opened room {room} within {timeout_s:g} s")
            self.fail(room, error)  # a late open is refused at once
            raise error from None

    async def wait_first(self, room: str, timeout_s: float) -> dict:
        """Decode side: the prompt's outcome once the prefill server has it (before the KV is written).
        A failure, a timeout or the decode side going away fails the room and closes it."""
        first = self._first_future(room)
        try:
            return await asyncio.wait_for(asyncio.shield(first), timeout_s)
        except TimeoutError:
            error = BootstrapTimeout(f"room {room}: the prefill server did not finish the prompt within "
                                     f"{timeout_s:g} s")
            self.fail(room, error)
            self.close(room)
            raise error from None
        except asyncio.CancelledError:
            self.fail(room, RoomFailed(f"room {room}: the decode side stopped waiting"))
            self.close(room)
            raise
        except BootstrapError:
            self.close(room)
            raise

    async def wait_done(self, room: str, timeout_s: float) -> dict:
        """Decode side: the prefill result (first token, digest, stats) once the KV has been written."""
        entry = self.rooms[room]
        try:
            return await asyncio.wait_for(asyncio.shield(entry.done), timeout_s)
        except TimeoutError:
            error = BootstrapTimeout(f"room {room}: the prefill server did not deliver the KV within {timeout_s:g} s")
            self.fail(room, error)
            if entry.barring is not None:  # a write in progress: the error line goes out once it ended
                await asyncio.shield(entry.barring)
            raise error from None
        except asyncio.CancelledError:  # the decode side's connection went away: no write may land now
            self.fail(room, RoomFailed(f"room {room}: the decode side stopped waiting"))
            raise
        finally:
            self.close(room)

    def complete(self, room: str, result: dict) -> None:
        entry = self.rooms.get(room)
        if entry is not None and not entry.done.done():
            entry.done.set_result(result)

    def fail(self, room: str, error: BootstrapError) -> None:
        """Fail `room`: its waiters get `error`, and no write into its pages starts from now on. A write
        in progress (the room's lock held) is waited out off the event loop, which serves every other
        room meanwhile (`_fail_after_write`); the room's done future, hence the decode side's error line
        (on which it frees the pages), fails only once that write ended."""
        entry = self.rooms.get(room)
        if entry is not None and not _bar_writes(entry, 0):
            if entry.barring is None:
                self._writing[room] = entry
                entry.barring = asyncio.ensure_future(self._fail_after_write(room, entry, error))
            return
        self._failed(room, entry, error)

    async def _fail_after_write(self, room: str, entry: Room, error: BootstrapError) -> None:
        await asyncio.to_thread(_bar_writes, entry, None)
        if self._writing.get(room) is entry:
            del self._writing[room]
        self._failed(room, entry, error)

    def _failed(self, room: str, entry: Room | None, error: BootstrapError) -> None:
        """`fail`'s notices, once no write into the room's pages is in progress or can start."""
        if entry is not None and not entry.done.done():
            entry.done.set_exception(error)
            entry.done.exception()  # retrieved: a room nobody waits on must not log "never retrieved"
        first = self._first.get(room)
        if first is not None and not first.done():
            first.set_exception(error)
            first.exception()
        opened = self._opened.get(room)
        if opened is not None and not opened.done():
            opened.set_exception(error)
            opened.exception()
            if entry is None:  # not opened yet: refuse its open for a while, then forget it
                asyncio.get_running_loop().call_later(self.forget_s, self._forget, room, opened)

    async def close_room(self, room: str, error: BootstrapError, timeout_s: float) -> bool:
        """Decode side's word: it gave `room` up and wants its pages (and receive slot) back. Fail the
        room for good: True once no write into its pages is in progress or can start (the room's lock
        taken, `closed` set under it), False when a write in progress still held the lock after
        `timeout_s`. A room not opened yet (or whose request has not even arrived) refuses its late
        open for `forget_s`. The wait for the lock runs off the event loop: a write in progress can take
        a while, and the loop serves every other room meanwhile."""
        self.expect(room)
        entry = self.rooms.get(room) or self._writing.get(room)
        if entry is not None and not _bar_writes(entry, 0) and \
                not await asyncio.to_thread(_bar_writes, entry, timeout_s):
            return False
        self.fail(room, error)
        return True

    async def drain(self, wait_s: float, write_timeout_s: float) -> list[str]:
        """A graceful shutdown's step before the server stops listening: open no new room, give the open
        ones up to `wait_s` to finish, then fail the rest once no write into their pages is in progress
        (each waited out for up to `write_timeout_s`, off the event loop). A decode side whose close finds
        the server gone ("connection refused") frees the room's pages after a short settle delay
        (runtime/disagg/decode.py); had the server stopped listening first, a write of its could still
        be landing in them then. Returns the rooms whose write outlasted `write_timeout_s`."""
        self.stopping = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while (self.rooms or self._writing) and loop.time() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        left = list(dict.fromkeys([*self.rooms, *self._writing]))
        closed = await asyncio.gather(*(self.close_room(
            room, PrefillStopping(room, was_open=True), write_timeout_s) for room in left))
        return [room for room, ok in zip(left, closed) if not ok]

    def _forget(self, room: str, opened: asyncio.Future) -> None:
        if self._opened.get(room) is opened:
            del self._opened[room]
            self._first.pop(room, None)

    def close(self, room: str) -> None:
        self.rooms.pop(room, None)
        self._opened.pop(room, None)
        self._first.pop(room, None)

    @property
    def open_rooms(self) -> int:
        return len(self.rooms)


def _bar_writes(entry: Room, timeout_s: float | None) -> bool:
    """Set `entry.closed` under its lock, waiting up to `timeout_s` for a write in progress (0: not at
    all, None: as long as it takes); False when the lock stayed held."""
    if not entry.lock.acquire(timeout=-1 if timeout_s is None else timeout_s):
        return False
    try:
        entry.closed = True
    finally:
        entry.lock.release()
    return True
