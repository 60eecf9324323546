"""The prefill server's side of PD: the bootstrap routes decode servers call, the chat path that runs
a prompt to its first token, and the engine-thread hook that writes the finished prompt's KV pages
into the decode server's pool.

The write happens on the engine thread right after the step that prefilled the request
(`EngineBridge.on_step`), before the next step is planned: the scheduler has already returned the
request's pages to the pool, but no later step has been planned onto them yet, so they still hold
exactly this prompt's KV (in the overlap loop too: the step already in flight was planned before
these pages were freed). The prefill side therefore holds no pages across the network wait, and an
abort on this side cannot leak any.
"""

from __future__ import annotations

import asyncio
import base64
import threading
import time
from dataclasses import replace

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from runtime.disagg.bootstrap import BootstrapError, BootstrapRegistry, BootstrapTimeout, Room, RoomFailed
from runtime.disagg.metrics import PDMetrics
from runtime.disagg.protocol import ROOM_HEADER, api_error
from runtime.disagg.transfer import KVTransfer, PoolDescriptor, kv_digest
from runtime.engine.engine import Engine, StepResult
from runtime.server.bridge import Accepted, Rejected
from runtime.server.errors import ApiError, bad_request


class PrefillSide:
    mode = "prefill"

    def __init__(self, engine: Engine, transfer: KVTransfer, registry: BootstrapRegistry, metrics: PDMetrics,
                 timeout_s: float) -> None:
        self.engine, self.transfer, self.registry, self.metrics = engine, transfer, registry, metrics
        self.timeout_s = timeout_s
        self._lock = threading.Lock()  # `pending` is shared by the event loop and the engine thread
        self.pending: dict[str, tuple[Room, asyncio.AbstractEventLoop]] = {}

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
            return {"session_id": session.session_id, "version": session.version}

        @app.post("/pd/transfer")
        async def transfer(request: Request) -> Response:
            """Decode side: open a room with its destination pages; answers once the KV is written."""
            body = await request.json()
            room = str(body["room"])
            try:
                self.registry.open(room, str(body["name"]), str(body["session_id"]),
                                   [int(p) for p in body["dst_pages"]])
                return JSONResponse(await self.registry.wait_done(room, self.timeout_s))
            except BootstrapError as exc:
                return api_error(exc).response()

    # ---- the chat path -----------------------------------------------------------------------------
    async def start(self, state, request: Request, rid: str, prepared) -> Response:
        room_id = request.headers.get(ROOM_HEADER)
        if not room_id:
            raise bad_request("this is a PD prefill server: requests come through `python -m runtime.router` "
                              f"(no {ROOM_HEADER} header)")
        try:
            room = await self.registry.wait_opened(room_id, self.timeout_s)
        except BootstrapError as exc:
            raise api_error(exc) from None
        needed = self.engine.pool.pages_for_tokens(len(prepared.prompt_ids))
        if len(room.dst_pages) < needed:
            error = RoomFailed(f"room {room_id}: decode gave {len(room.dst_pages)} pages for {needed}")
            self.registry.fail(room_id, error)
            raise api_error(error)
        with self._lock:
            self.pending[rid] = (room, asyncio.get_running_loop())
        # The prompt and exactly one token: the same prefill step the colocated server runs.
        sink = state.bridge.submit(rid, prepared.prompt_ids, replace(prepared.params, max_tokens=1))
        try:
            first = await sink.get()
            if isinstance(first, Rejected):
                self.registry.fail(room_id, RoomFailed(f"rejected by the prefill server: {first.message}"))
                raise bad_request(f"request rejected: {first.message}")
            assert isinstance(first, Accepted)
            result = await asyncio.wait_for(asyncio.shield(room.done), self.timeout_s)
        except BootstrapError as exc:
            raise api_error(exc) from None
        except TimeoutError:
            state.bridge.abort(rid)
            timeout = BootstrapTimeout(f"room {room_id}: prefill did not finish within {self.timeout_s:g} s")
            self.registry.fail(room_id, timeout)
            raise api_error(timeout) from None
        except asyncio.CancelledError:  # the router went away: stop the prefill, tell the decode side
            state.bridge.abort(rid)
            self.registry.fail(room_id, RoomFailed(f"room {room_id}: aborted on the prefill server"))
            raise
        finally:
            with self._lock:
                self.pending.pop(rid, None)
        return JSONResponse({"room": room_id, "prefilled": True, "kv_bytes": result["kv_bytes"],
                             "transfer_seconds": result["transfer_seconds"]})

    # ---- engine thread -----------------------------------------------------------------------------
    def on_step(self, result: StepResult) -> None:
        for req in result.finished:
            with self._lock:
                waiting = self.pending.pop(req.rid, None)
            if waiting is None:
                continue
            room, loop = waiting
            try:
                outcome = self._write(req, room, result)
            except Exception as exc:  # a failed write fails this request only, never the engine thread
                self.metrics.transfers.labels("failed").inc()
                error = exc if isinstance(exc, BootstrapError) else RoomFailed(f"room {room.room}: {exc}")
                loop.call_soon_threadsafe(self.registry.fail, room.room, error)
                continue
            self.metrics.transfers.labels("ok").inc()
            loop.call_soon_threadsafe(self.registry.complete, room.room, outcome)

    def _write(self, req, room: Room, result: StepResult) -> dict:
        if req.finish_reason == "abort":
            raise RoomFailed(f"room {room.room}: aborted on the prefill server")
        # Its prefill extend (first_page 0: a prefill always starts a fresh table) lists every page.
        pages = next(ext.new_pages for ext in result.plan.extends if ext.rid == req.rid)
        num_tokens = len(req.prompt_ids)
        src = list(pages[:self.engine.pool.pages_for_tokens(num_tokens)])
        started = time.perf_counter()
        with room.lock:
            if room.closed:  # the decode side gave up (timeout, abort): its pages may be reused by now
                raise RoomFailed(f"room {room.room}: the decode side is no longer waiting")
            stats = self.transfer.write_pages(room.session.pool, src, room.dst_pages[:len(src)])
        digest = kv_digest(self.transfer.latent, self.transfer.index_keys, src, self.engine.pool.page_size,
                           num_tokens)
        self.metrics.transfer_bytes.inc(stats.bytes)
        self.metrics.transfer_seconds.observe(stats.seconds)
        assert req.generator is not None
        return {"token": req.output_ids[0],
                "logprob": req.output_logprobs[0] if req.output_logprobs else None,
                "top": req.output_top_logprobs[0] if req.output_top_logprobs else [],
                "num_sampled": req.num_sampled,
                # The sampler's generator after the first draw: a seeded request continues its stream.
                "generator": base64.b64encode(req.generator.get_state().numpy().tobytes()).decode(),
                "digest": digest, "kv_bytes": stats.bytes, "chunks": stats.chunks,
                "transfer_seconds": stats.seconds, "prefill_seconds": time.perf_counter() - started}
