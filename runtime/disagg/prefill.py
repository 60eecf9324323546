"""The prefill server's side of PD: the bootstrap routes decode servers call, the chat path that runs
a prompt to its first token, and the code that writes the finished prompt's KV pages into the decode
server's pool.

The prompt is computed as soon as the request arrives, whether or not its decode server has opened
the room yet (its page reservation and the HTTP call that opens the room run meanwhile, off the
critical path). The engine keeps the finished request's pages (`keep_pages`), so they hold exactly
this prompt's KV until this side gives them back - to the prefix cache when it is on (the KV is the
prompt's, complete and final: a later prompt that starts alike copies it instead of recomputing it; in
the 80-session PD gate each turn re-sends its whole conversation), else to the pool:

- the pages of a finished prompt are *held* (`Pending.held`, counted in `dsv4_pd_pages_in_flight`)
  and written by a worker thread as soon as its room is open - at once when it already is - then
  given back on the engine thread (`_give_back`). Owned pages: no step can touch them meanwhile (nor
  can eviction: they are not the cache's yet), so the engine thread goes on to its next step instead of
  hashing and writing the KV (on a busy prefill server that thread is the bottleneck of the pair);
- the room never opens (deadline), fails, or the caller goes away (timeout, disconnect, cancel):
  `_release` aborts the prompt if it is still queued or computing (the scheduler frees an aborted
  prompt's pages: its KV may be partial), or gives the held pages back (their KV is complete: they may
  go to the cache). Every path ends with the pages back in the pool or the cache, whichever of the
  event loop and the engine thread gets to the request first (`_lock`).
"""

from __future__ import annotations

import asyncio
import base64
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable
from concurrent import futures
from dataclasses import dataclass, replace
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from runtime.disagg.bootstrap import BootstrapError, BootstrapRegistry, BootstrapTimeout, Room, RoomFailed
from runtime.disagg.metrics import PDMetrics
from runtime.disagg.protocol import (
    RELAY_HEADER,
    RELAY_MEDIA_TYPE,
    ROOM_HEADER,
    TRANSFER_MEDIA_TYPE,
    PrefillStopping,
    api_error,
    first_token_of,
    relay_line,
    relays_first_token,
    settle_relay,
    transfer_error,
    transfer_line,
)
from runtime.disagg.transfer import KVTransfer, PoolDescriptor, digest_workers, kv_digest, mode_mismatch
from runtime.engine.engine import Engine, StepResult
from runtime.server import serving
from runtime.server.app import stream_encoder
from runtime.server.bridge import Accepted, Rejected
from runtime.server.errors import ApiError, bad_request
from runtime.server.output import ChoiceBuilder
from runtime.server.request_body import until_disconnected
from runtime.server.trace import NO_TRACE, Trace

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class Held:
    """A finished prompt's KV, kept in its pages until its room opens."""

    pages: list[int]  # the request's pages, owned by it in the pool until given back
    # The ids whose KV the pages hold, final (`all_ids[:num_computed]` as the request finished: the
    # prompt; the first token has no KV): what keys the pages in the prefix cache.
    ids: list[int]
    outcome: dict  # what the decode side needs besides the KV and its digest (first token, sampler state)
    trace: Trace = NO_TRACE  # its request's, for the write's marks

    @property
    def num_tokens(self) -> int:
        """The prompt's: its KV fills the first pages_for_tokens(num_tokens) pages."""
        return len(self.ids)


@dataclass
class Pending:
    """One request of this server between its arrival and its KV write (`PrefillSide.pending`)."""

    room_id: str
    loop: asyncio.AbstractEventLoop
    state: object  # the server's state: its bridge frees the pages once they are written
    room: Room | None = None  # set once the decode side has opened the room
    held: Held | None = None  # set once the prompt finished while the room was not open yet
    trace: Trace = NO_TRACE
    # Set when the router asked for the first token's chunk (runtime/disagg/protocol.py): gets the prompt's
    # outcome first thing on the event loop once the prompt finished (`on_step`), or None when it will not.
    relay: asyncio.Future | None = None


class PrefillSide:
    mode = "prefill"

    def __init__(self, engine: Engine, transfer: KVTransfer, registry: BootstrapRegistry, metrics: PDMetrics,
                 timeout_s: float) -> None:
        self.engine, self.transfer, self.registry, self.metrics = engine, transfer, registry, metrics
        self.timeout_s = timeout_s
        self.faults = engine.faults
        self._lock = threading.Lock()  # `pending` (and its entries) is shared by the event loop and the engine thread
        self.pending: dict[str, Pending] = {}
        self._sending: set[asyncio.Task] = set()  # writes of held KV in progress (a reference each)
        # The sender's KV digests, each beside its write (`_write`): both read the same owned pages.
        self._digests = digest_workers()

    @property
    def draining(self) -> bool:
        """Whether a graceful shutdown has begun: no room opens any more (the server's /health says 503)."""
        return self.registry.stopping

    async def drain(self) -> None:
        """At a graceful shutdown, before the server stops listening (runtime/server/serving.py): the
        open rooms finish or fail, and no KV write is left in progress (`BootstrapRegistry.drain`). The
        rooms get the grace uvicorn gives open connections (`serving.GRACEFUL_SHUTDOWN_S`, read here at
        each call)."""
        stuck = await self.registry.drain(serving.GRACEFUL_SHUTDOWN_S, self.timeout_s)
        if stuck:
            log.error("shutting down with KV writes still in progress into rooms %s after %g s: their decode "
                      "servers may free those pages while the writes land", stuck, self.timeout_s)

    async def aclose(self) -> None:
        """At server shutdown: stop the digest threads (the decode side closes an HTTP client here)."""
        self._digests.shutdown(wait=False)

    # ---- routes the decode servers call ----------------------------------------------------------
    def add_routes(self, app: FastAPI) -> None:
        @app.post("/pd/register")
        async def register(request: Request) -> dict:
            body = await request.json()
            session = self.registry.register(str(body["name"]), str(body["instance"]),
                                             PoolDescriptor.from_dict(body["pool"]))
            mine = self.transfer.descriptor()
            if session.pool.layout() != mine.layout():
                raise ApiError(409, f"decode pool layout {session.pool.layout()} differs from the prefill "
                                    f"server's {mine.layout()}", type="server_error", code="pd_layout_mismatch")
            mismatch = mode_mismatch(mine, session.pool)
            if mismatch:
                raise ApiError(409, f"decode and prefill servers cannot exchange KV: {mismatch}",
                               type="server_error", code="pd_mode_mismatch")
            # `room_close`: this server confirms room closes (POST /pd/rooms/{room}/close), so a decode
            # server knows at once whether the rooms it gives up here can get their pages back.
            return {"session_id": session.session_id, "version": session.version, "room_close": True}

        @app.post("/pd/transfer")
        async def transfer(request: Request) -> Response:
            """Decode side: open a room with its destination pages. A room that cannot open (a stale
            session, a server shutting down, a bad request) is a plain error response. An open room's
            answer starts at once, so its headers are out while the prompt computes and the first line
            travels alone on the open stream (the headers went out with that line before: 1.2 ms from
            the line's `yield` to the decode side's read on the 2-core host, one request at a time). Its
            body is two JSON lines: the prompt's outcome (first token, sampler state) as soon as the
            prompt finished, then, once the KV is written, the result (digest, stats); an error line
            in place of either."""
            body = await request.json()
            room = str(body["room"])
            trace = app.state.server.traces.start(request.headers)  # the chat request's, when it is traced
            try:
                offset = body.get("staging_offset")
                self.registry.open(room, str(body["name"]), str(body["session_id"]),
                                   [int(p) for p in body["dst_pages"]], None if offset is None else int(offset))
            except BootstrapError as exc:
                return api_error(exc).response()
            trace.mark("room_opened")
            return StreamingResponse(self._transfer_lines(room, trace), media_type=TRANSFER_MEDIA_TYPE)

        @app.post("/pd/rooms/{room}/close")
        async def close_room(room: str, request: Request) -> dict:
            return await self._close_room(room, request)

    async def _close_room(self, room: str, request: Request) -> dict:
        """/pd/rooms/{room}/close: the decode side gave the room up before its KV arrived (its client
        left, an error, its deadline) and frees the room's pages and receive slot once this answers: so
        it answers only when no write into them is in progress or can start (`close_room`), and a 504
        (pd_write_in_progress) when a write still runs at the PD deadline: the decode side then keeps
        those pages out of its pool until a retried close is answered. Our own pages come back on the
        request's usual path (the room fails, `start` gives the request up)."""
        body = await request.json()
        error = RoomFailed(f"room {room}: given up by decode server {body.get('name')!r} "
                           f"({body.get('reason') or 'no reason given'})")
        if not await self.registry.close_room(room, error, self.timeout_s):
            raise ApiError(504, f"room {room}: its KV write was still in progress after {self.timeout_s:g} s",
                           type="server_error", code="pd_write_in_progress")
        return {"room": room, "closed": True}

    async def _transfer_lines(self, room: str, trace: Trace) -> AsyncIterator[bytes]:
        """/pd/transfer's body: the outcome line once the prompt finished, then the result line once the
        KV is written (an error line in place of either). The decode side hanging up cancels this,
        which fails the room (`wait_first`, `wait_done`): no write lands."""
        for line, wait, mark in (("first", self.registry.wait_first, "first_replying"),
                                 ("done", self.registry.wait_done, "transfer_replying")):
            try:
                value = await wait(room, self.timeout_s)
            except BootstrapError as exc:
                yield transfer_line(error=transfer_error(api_error(exc)))
                return
            trace.mark(mark)
            yield transfer_line(**{line: value})

    # ---- the chat path -----------------------------------------------------------------------------
    async def start(self, state, request: Request, rid: str, prepared, trace: Trace = NO_TRACE) -> Response:
        room_id = request.headers.get(ROOM_HEADER)
        if not room_id:
            raise bad_request("this is a PD prefill server: requests come through `python -m runtime.router` "
                              f"(no {ROOM_HEADER} header)")
        if self.registry.stopping:  # its room could not open: no prompt computed for nobody
            raise api_error(PrefillStopping(room_id))
        self.registry.expect(room_id)
        loop = asyncio.get_running_loop()
        relay = loop.create_future() if request.headers.get(RELAY_HEADER) == "1" else None
        with self._lock:
            self.pending[rid] = Pending(room_id, loop, state, trace=trace, relay=relay)
        # The prompt and exactly one token: the same prefill step the colocated server runs. It starts
        # now; the room is awaited meanwhile.
        sink = state.bridge.submit(rid, prepared.prompt_ids, replace(prepared.params, max_tokens=1), keep_pages=True,
                                   trace=trace)
        # The caller (the router) going away gives the request up at once: its held pages are freed
        # now, not at the deadline.
        watcher = asyncio.ensure_future(self._watch_disconnect(state, request, rid, room_id))
        try:
            await self._failing_the_room(state, rid, room_id, self._accepted(room_id, sink))
            if relay is None:
                result = await self._failing_the_room(state, rid, room_id, self._written(state, rid, room_id, prepared))
        except BaseException:
            watcher.cancel()
            if relay is not None:
                settle_relay(relay, None)
            raise
        if relay is None:
            watcher.cancel()
            return JSONResponse(_answer(room_id, result))
        written = asyncio.ensure_future(
            self._failing_the_room(state, rid, room_id, self._written(state, rid, room_id, prepared)))
        written.add_done_callback(lambda done: _nothing_to_relay(done, relay))
        return StreamingResponse(self._relaying(state, request, prepared, relay, written, watcher, trace),
                                 media_type=RELAY_MEDIA_TYPE)

    async def _failing_the_room(self, state, rid: str, room_id: str, work: Awaitable[T]) -> T:
        """`work`, whose failure gives the request up here and fails its room: a bootstrap failure or
        the deadline as the client's error; anything else (cancelled, a rejected request, a bug) tells
        the decode side the room was aborted."""
        try:
            return await work
        except BootstrapError as exc:
            self._release(state, rid)
            self.registry.fail(room_id, exc)
            raise api_error(exc) from None
        except TimeoutError:
            self._release(state, rid)
            timeout = BootstrapTimeout(f"room {room_id}: prefill did not finish within {self.timeout_s:g} s")
            self.registry.fail(room_id, timeout)
            raise api_error(timeout) from None
        except BaseException:
            self._release(state, rid)
            self.registry.fail(room_id, RoomFailed(f"room {room_id}: aborted on the prefill server"))
            raise

    async def _accepted(self, room_id: str, sink: asyncio.Queue) -> None:
        first = await sink.get()
        if isinstance(first, Rejected):
            self.registry.fail(room_id, RoomFailed(f"rejected by the prefill server: {first.message}"))
            raise bad_request(f"request rejected: {first.message}")
        assert isinstance(first, Accepted)

    async def _written(self, state, rid: str, room_id: str, prepared) -> dict:
        """The room's result once the decode side opened it and the prompt's KV is written into it."""
        room = await self.registry.wait_opened(room_id, self.timeout_s)
        needed = self.engine.pool.pages_for_tokens(len(prepared.prompt_ids))
        if len(room.dst_pages) < needed:
            raise RoomFailed(f"room {room_id}: decode gave {len(room.dst_pages)} pages for {needed}")
        self._room_opened(state, rid, room)
        return await asyncio.wait_for(asyncio.shield(room.done), self.timeout_s)

    async def _relaying(self, state, request: Request, prepared, relay: asyncio.Future, written: asyncio.Task,
                        watcher: asyncio.Task, trace: Trace) -> AsyncIterator[bytes]:
        """The relaying prompt answer (runtime/disagg/protocol.py): the client's first bytes as soon as the
        prompt finished (null when not relayed, or when the room failed first), then the room's result
        or error line. The router hanging up cancels this, which gives the request up (`written`)."""
        try:
            first = await relay
            text = self._relay_text(state, request, prepared, first) if first and first.get("relayed") else None
            self.metrics.first_tokens.labels("relayed" if text is not None else "not_relayed").inc()
            yield relay_line(text)
            trace.mark("first_relayed")
            try:
                result = await written
            except ApiError as exc:
                yield transfer_line(error=transfer_error(exc))
                return
            yield transfer_line(done=_answer(str(request.headers[ROOM_HEADER]), result))
        finally:
            watcher.cancel()
            written.cancel()

    def _relay_text(self, state, request: Request, prepared, first: dict) -> str:
        """The opening chunk and the first token's chunk, as the decode server's stream would write them
        (runtime/server/app.py `_stream`): the same envelope (`stream_encoder`: the room's id, the router's
        `created`) and the same output state, pushed the same token (`first_token_of`, not a stop token)."""
        encoder = stream_encoder(state, "", request)  # a PD request: the id is the room's, not the rid
        builder = ChoiceBuilder(self.engine.tokenizer, prepared.output, prepared.corruptor)
        token, logprob, top = first_token_of(first, prepared.params.logprobs)
        return encoder.opening() + encoder.token_chunk(builder.push(token, logprob, top, False))

    async def _watch_disconnect(self, state, request: Request, rid: str, room_id: str) -> None:
        """The caller going away gives the request up."""
        await until_disconnected(request)
        self._release(state, rid)
        self.registry.fail(room_id, RoomFailed(f"room {room_id}: the prefill server's caller went away"))

    def _room_opened(self, state, rid: str, room: Room) -> None:
        """The decode side opened the room: the KV is written when the prompt finishes (`on_step`), or
        now when it already has."""
        with self._lock:
            entry = self.pending.get(rid)
            if entry is None:  # released meanwhile (the caller went away)
                raise RoomFailed(f"room {room.room}: the request was given up on the prefill server")
            entry.room = room
            held = entry.held
            if held is not None:
                del self.pending[rid]
        if held is not None:
            self._start_send(state, rid, room, held)

    def _start_send(self, state, rid: str, room: Room, held: Held) -> None:
        """On the event loop: write the held KV on a worker thread (`_send_held`)."""
        task = asyncio.ensure_future(self._send_held(state, rid, room, held))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _send_held(self, state, rid: str, room: Room, held: Held) -> None:
        """Write held KV into the opened room off the event loop, then free the pages. A task of its own:
        cancelling the request does not stop a write in progress, so the pages are freed only after it."""
        try:
            outcome = await asyncio.to_thread(self._write, room, held)
        except Exception as exc:
            self.metrics.transfers.labels("failed").inc()
            error = exc if isinstance(exc, BootstrapError) else RoomFailed(f"room {room.room}: {exc}")
            self.registry.fail(room.room, error)
        else:
            self.metrics.transfers.labels("ok").inc()
            self.registry.complete(room.room, outcome)
            held.trace.mark("room_completed")
        finally:
            self._give_back(state, rid, held)

    def _release(self, state, rid: str) -> None:
        """Give request `rid` up (idempotent): abort its prompt if it is still queued or computing (the
        scheduler frees its pages, or `on_step` gives them back if it finishes first), or give its held
        KV pages back."""
        with self._lock:
            entry = self.pending.pop(rid, None)
        if entry is None:  # done already, or its held KV is being written (that write gives the pages back)
            return
        if entry.held is None:
            state.bridge.abort(rid)
        elif not self.faults.enabled("pd-abort-leak"):  # the fault: a given-up request's held pages leak
            self._give_back(state, rid, entry.held)

    def _give_back(self, state, rid: str, held: Held) -> None:
        """Hand the held pages back on the engine thread (the pool and the cache are its state): their
        full pages to the prefix cache when it is on (the KV is final whether or not it was sent: no
        step writes a held page, a failed write only touches the decode side's), the rest freed."""
        def give_back(engine: Engine) -> None:
            engine.scheduler.release_pages(rid, held.pages, held.ids)
            self.metrics.pages_in_flight.dec(len(held.pages))

        state.bridge.call(give_back).add_done_callback(_log_failure)

    # ---- engine thread -----------------------------------------------------------------------------
    def on_step(self, result: StepResult) -> None:
        """Keep each finished prompt's pages for its room (the write happens off this thread), or give
        them back when nobody will take them."""
        for req in result.finished:
            if not req.keep_pages:
                continue
            rid = req.rid
            held = None
            if req.finish_reason != "abort" and req.pages:  # finished normally: the scheduler kept the pages
                held = Held(list(req.pages), req.all_ids[:req.num_computed], self._outcome(req))
            with self._lock:
                entry = self.pending.get(rid)
                room = entry.room if entry is not None else None
                if entry is not None and held is not None:
                    held.trace = entry.trace
                    held.trace.mark("kv_held")
                    held.outcome["relayed"] = entry.relay is not None and relays_first_token(
                        held.outcome["token"], self.engine.tokenizer.eos_token_id, req.params.stop_token_ids)
                if entry is not None and (held is None or room is not None):
                    del self.pending[rid]
                elif entry is not None:
                    entry.held = held  # the room is not open yet: keep the KV for it
                if entry is not None and held is not None:
                    self.metrics.pages_in_flight.inc(len(held.pages))
            if entry is None:  # given up while it computed: nobody will write its KV (complete: it may be cached)
                if held is not None and not self.faults.enabled("pd-abort-leak"):
                    self.engine.scheduler.release_pages(rid, held.pages, held.ids)
            elif held is None:  # aborted, or preempted with its prefill in flight (no KV kept)
                self.metrics.transfers.labels("failed").inc()
                error = RoomFailed(f"room {entry.room_id}: the prompt was aborted on the prefill server")
                entry.loop.call_soon_threadsafe(self.registry.fail, entry.room_id, error)
            else:
                # The first token goes out now, before the KV is written (the loop runs these in order):
                # to the router first when it relays it, then to the decode side, then the write starts.
                if entry.relay is not None:
                    entry.loop.call_soon_threadsafe(settle_relay, entry.relay, held.outcome)
                entry.loop.call_soon_threadsafe(self.registry.prefilled, entry.room_id, held.outcome)
                if room is not None:
                    entry.loop.call_soon_threadsafe(self._start_send, entry.state, rid, room, held)

    def _outcome(self, req) -> dict:
        """What the decode side needs besides the KV, read on the engine thread as the prompt finishes."""
        assert req.generator is not None
        return {"token": req.output_ids[0],
                "logprob": req.output_logprobs[0] if req.output_logprobs else None,
                "top": req.output_top_logprobs[0] if req.output_top_logprobs else [],
                "num_sampled": req.num_sampled,
                # The sampler's generator after the first draw: a seeded request continues its stream.
                "generator": base64.b64encode(req.generator.get_state().numpy().tobytes()).decode()}

    def _write(self, room: Room, held: Held) -> dict:
        """Put the held KV into the room's pages, with the digest of what was sent (a worker thread: the
        pages are owned by the request, so no step writes them meanwhile). The digest is computed on
        a thread of its own beside the gather and write, which read the same pages: both spend their
        time outside the GIL (CRC-32, torch copies, Mooncake), so the slower one sets the pace."""
        src = held.pages[:self.engine.pool.pages_for_tokens(held.num_tokens)]
        started = time.perf_counter()
        held.trace.mark("write_started")
        digesting = self._digests.submit(self._digest, src, held)
        try:
            with room.lock:
                if room.closed:  # the decode side gave up (timeout, abort): its pages may be reused by now
                    raise RoomFailed(f"room {room.room}: the decode side is no longer waiting")
                stats = self.transfer.write_pages(room.session.pool, src, room.dst_pages[:len(src)],
                                                  staging_offset=room.staging_offset, trace=held.trace)
            held.trace.mark("kv_written")
        finally:
            futures.wait([digesting])  # the pages are freed after this returns: nothing may read them then
        digest = digesting.result()
        held.trace.mark("kv_digest_awaited")
        self.metrics.transfer_bytes.inc(stats.bytes)
        self.metrics.transfer_seconds.observe(stats.seconds)
        # The outcome went out in the answer's first line (`prefilled`): the result is the KV's alone.
        return {"digest": digest, "kv_bytes": stats.bytes, "chunks": stats.chunks,
                "transfer_seconds": stats.seconds, "prefill_seconds": time.perf_counter() - started}

    def _digest(self, src: list[int], held: Held) -> str:
        digest = kv_digest(self.transfer.latent, self.transfer.index_keys, src, self.engine.pool.page_size,
                           held.num_tokens)
        held.trace.mark("kv_digested")
        return digest


def _nothing_to_relay(written: asyncio.Task, relay: asyncio.Future) -> None:
    """`written` ended: a room that failed, or a deadline, before the prompt finished leaves nothing to
    relay. Its failure is retrieved here too: the relaying answer reads it as its error line, but an answer
    whose caller left before its first write never runs."""
    settle_relay(relay, None)
    if not written.cancelled():
        written.exception()


def _answer(room_id: str, result: dict) -> dict:
    """The prompt answer's result: the room, and what its KV write took."""
    return {"room": room_id, "prefilled": True, "kv_bytes": result["kv_bytes"],
            "transfer_seconds": result["transfer_seconds"]}


def _log_failure(future: asyncio.Future) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.error("giving back held PD pages failed", exc_info=future.exception())
