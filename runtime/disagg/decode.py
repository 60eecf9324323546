"""The decode server's side of PD: reserve pages for a prompt's KV (and, in staged transfer mode, a
receive slot of the staging arena), register with the request's prefill server (once per prefill
server and session), open the request's room with those page ids (and the slot), open the client's
answer (a stream's headers go out while the prompt computes), send the first token (the prefill side's:
the first line of its answer, which comes as soon as the prompt finished) to the client at once (a
stream's goes from the prefill server to the router, which relays it: then it is taken into the
request's output and RELAYED_EVENT written in its place, runtime/disagg/protocol.py), wait
for the KV (the answer's second line), scatter it from the slot into the pages (staged), check it, and
hand the request to the engine as already prefilled; its later tokens come from the engine, so none
reaches the client before the check passed. A failure once the room is open (the prefill side's error
line, its answer broken off, a failed transfer or check) ends the client's stream with its error
(pd_kv_corrupt for a corrupt KV), before or after its first token; the router offers a stream that
failed before its first token because the prefill server took nothing of it (pd_prefill_stopping,
pd_prefill_unreachable) to another prefill server inside the same stream.

The reserved pages are freed on every path that does not end in admission (timeout, prefill error,
corrupt KV, client gone before the KV arrived, server shutdown in any phase: `aclose` ends the pending
checks and waits for their frees, which `EngineBridge.call` still applies once the engine thread has
stopped); a request admitted to the engine is freed by the scheduler as usual, and one whose client
left while its KV was checked is admitted, then aborted (its abort kept by the bridge). The receive
slot is freed on every path, admission included (the KV is in the pages by then).

Not before the prefill side can no longer write into them, though: a request given up while its room
may be open there (its /pd/transfer call out, the answer's last line not in) has the room closed on
the prefill server first (`POST /pd/rooms/{room}/close`, which answers once no write is in progress
or can start), beside the client's error; only then do its pages and slot go back. Freed at once,
they could be another request's by the time a write in progress lands. A close that is not confirmed
within the PD timeout (the prefill server hangs, answers an error, or cannot be reached but did not
refuse the connection) quarantines them: out of the pools (`dsv4_pd_quarantined_pages`), while the
close is sent again with a growing, bounded, jittered wait (`retry_waits`); a confirmed (or refused) retry puts
them back (`dsv4_pd_quarantines_lifted`). A network blip or a pause of the prefill server costs the
pages for seconds, not until a restart. Shutdown stops the retries and keeps what is quarantined.

A prefill server older than the close route answers it 404: it never confirms that no write can
land, and nothing else bounds its writes from here: its room deadlines run on its own clock and bound
its waits, not a write in progress (a transfer engine call with no deadline of ours), and the oldest
versions did not even bar writes into a failed room. So those pages stay quarantined too, and one line
per prefill server says to upgrade it; the close is still tried every QUARANTINE_RETRY_MAX_S, so an
upgraded (restarted: the old process and its writes are gone) server gets them back.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import random
import uuid
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from fastapi import Request

from runtime.disagg.metrics import PDMetrics
from runtime.disagg.protocol import (
    BOOTSTRAP_HEADER,
    ROOM_HEADER,
    ends_the_write,
    error_from_body,
    first_token_of,
    parse_transfer_line,
    transfer_value,
)
from runtime.disagg.transfer import KVTransfer, digest_workers, kv_digest
from runtime.engine.engine import Engine
from runtime.engine.request import Request as EngineRequest
from runtime.engine.request import stop_reason
from runtime.faults import FaultSet
from runtime.kvcache.page_pool import OutOfPagesError
from runtime.server.bridge import Accepted, Failed, TokenOut, is_stop_token
from runtime.server.errors import ApiError, bad_request
from runtime.server.trace import NO_TRACE, Trace
from runtime.upstream_http import UpstreamConnectError, UpstreamError, UpstreamReply, Upstreams

log = logging.getLogger(__name__)
# How long the pages of a room whose prefill server refused the close (nothing listens there) are held
# before they go back: long enough for bytes the dead sender had put on the wire to have landed.
REFUSED_SETTLE_S = 0.5
# The outcomes of a close (`_close_room`) after which no KV write can land in the room's pages any more
# (refused: once REFUSED_SETTLE_S passed), so they may go back. Any other outcome quarantines them.
RELEASING_OUTCOMES = frozenset({"closed", "refused"})
# A quarantined room's close is sent again after QUARANTINE_RETRY_FIRST_S, then after waits growing by
# QUARANTINE_RETRY_GROWTH up to QUARANTINE_RETRY_MAX_S, for as long as the server runs. The first retry
# comes soon: the blips this is for (a GC pause, a network hiccup, a write that was still in progress
# at the prefill side's deadline) are over within seconds, and the first close already waited up to
# the PD timeout. The cap bounds what a prefill server that is gone for a long time costs (one small
# request a minute per quarantined room) and how long its pages stay out once it is back.
QUARANTINE_RETRY_FIRST_S = 2.0
QUARANTINE_RETRY_GROWTH = 2.0
QUARANTINE_RETRY_MAX_S = 60.0
# Each wait is shortened by up to this share, at random: the rooms one blip quarantined together (a
# prefill server that stalled for a few seconds) would otherwise send their closes in step, every time.
QUARANTINE_RETRY_JITTER = 0.25


class DecodeSide:
    mode = "decode"
    draining = False  # a decode server has no drain step: at shutdown its requests end with its engine

    def __init__(self, engine: Engine, transfer: KVTransfer, name: str, metrics: PDMetrics, timeout_s: float,
                 faults: FaultSet, api_key: str | None = None) -> None:
        """`api_key`: the bearer key this server shows the prefill servers' /pd routes (a pair shares
        the key its clients use: the router forwards theirs to both servers)."""
        self.engine, self.transfer, self.name, self.metrics = engine, transfer, name, metrics
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.faults = faults
        self.sessions: dict[str, str] = {}  # prefill URL -> our current session id there
        self.instance = uuid.uuid4().hex  # this process: a restart registers as a new instance
        self._registering: dict[str, asyncio.Lock] = {}  # one registration at a time per prefill server
        self._client: tuple[asyncio.AbstractEventLoop, Upstreams] | None = None
        # The receiver's KV digests (`start`), off the engine thread.
        self._digests = digest_workers()
        self._verifying: set[asyncio.Task] = set()  # `_verify_then_admit` of requests whose first token is out
        self._closing: set[asyncio.Task] = set()  # `_close_then_release` of rooms given up
        self._retrying: set[asyncio.Task] = set()  # `_retry_quarantined` of rooms quarantined
        self._stopping = False  # set by `aclose`: no close is retried from then on
        self._no_close_route: set[str] = set()  # prefill servers told to upgrade (the 404 line, once each)

    def client(self) -> Upstreams:
        """One HTTP client for every call to the prefill servers, made in the server's event loop: the
        router's lean one (runtime/upstream_http.py), since the /pd/transfer answer's first line carries
        the first token. (An httpx client per request once cost its TLS context: 69% of the decode
        server's event loop under a 40-session PD gate.) No connection cap: each room's /pd/transfer call
        waits for its KV, so a capped pool would make a request wait for a connection while its prefill
        side waits for the room to open. Its timeout is 5 s over the PD deadline, which answers first."""
        loop = asyncio.get_running_loop()
        if self._client is None or self._client[0] is not loop:
            headers = {"authorization": f"Bearer {self.api_key}"} if self.api_key is not None else None
            self._client = (loop, Upstreams(self.timeout_s + 5, headers=headers))
        return self._client[1]

    async def aclose(self) -> None:
        """At server shutdown: end the KV checks still pending (their streams are gone with the server),
        each giving back its pages and receive slot before this returns, whether its landing or digest
        had started or not; stop retrying the closes of quarantined rooms (their pages stay out); then
        stop the digest threads and close the HTTP client (its pooled connections to the prefill
        servers)."""
        self._stopping = True
        # Checks spawned before this call take their first step first: a task cancelled before it ever
        # ran never runs its `finally`.
        await asyncio.sleep(0)
        await _cancel_and_wait(self._verifying)
        # Rooms still being closed on their prefill server (and those the checks just ended gave up):
        # cancelled, each frees its pages and slot at once (the engine has stopped: nothing can be
        # admitted into them any more).
        await asyncio.sleep(0)
        await _cancel_and_wait(self._closing)
        # Retried closes of quarantined rooms stop; their pages stay quarantined (a write may still land
        # there, and the process is going away).
        await _cancel_and_wait(self._retrying)
        self._digests.shutdown(wait=False, cancel_futures=True)
        if self._client is not None:
            loop, client = self._client
            self._client = None
            if loop is asyncio.get_running_loop():
                await client.aclose()

    def add_routes(self, app) -> None:
        """The decode side serves nothing extra: it calls the prefill server's bootstrap routes."""

    async def _session(self, client: Upstreams, prefill: str, stale: str | None = None) -> str:
        """Our session at `prefill`, registering when there is none (or only the `stale` one)."""
        async with self._registering.setdefault(prefill, asyncio.Lock()):
            current = self.sessions.get(prefill)
            if current is not None and current != stale:
                return current  # another request registered while this one waited
            reply = await client.request("POST", f"{prefill}/pd/register", json_body={
                "name": self.name, "instance": self.instance, "pool": self.transfer.descriptor().to_dict()})
            content = await reply.aread()
            if reply.status_code != 200:
                raise error_from_body(reply.status_code, _json(content), f"registering with {prefill} failed")
            registered = json.loads(content)
            if registered.get("room_close"):
                self._no_close_route.discard(prefill)  # upgraded: a downgrade is reported again
            else:  # an older prefill server: say so now, not at the first room given up there
                self._report_no_close_route(prefill, "its /pd/register answer does not offer one")
            self.sessions[prefill] = registered["session_id"]
            return self.sessions[prefill]

    async def _open_room(self, link: RoomLink, pages: list[int], staging: int | None,
                         trace: Trace = NO_TRACE) -> TransferAnswer:
        """Open the room at the prefill server: its answer, once its headers are in (the room is open),
        whose lines are the prompt's outcome (first token, sampler state), as soon as the prefill side has
        it, then the KV's result. `link` says meanwhile whether the prefill side may write into the pages."""
        prefill, room = link.prefill, link.room
        client = self.client()
        refused: str | None = None
        for attempt in range(2):
            session = await self._session(client, prefill, refused)
            trace.mark("transfer_requested")
            link.may_write = True  # from the first byte sent: the room may be open before any answer
            reply = await client.request("POST", f"{prefill}/pd/transfer", trace.headers(), json_body={
                "room": room, "name": self.name, "session_id": session, "dst_pages": pages,
                "staging_offset": staging})
            if reply.status_code != 200:
                body = _json(await reply.aread())
                link.may_write = not _refused_the_room(reply.status_code, body)
                stale = reply.status_code == 409 and body.get("error", {}).get("code") == "pd_stale_session"
                if stale and attempt == 0:  # the prefill server restarted: register once more
                    refused = session
                    continue
                raise error_from_body(reply.status_code, body, f"KV transfer for room {room} failed")
            return TransferAnswer(reply, link)
        raise AssertionError("unreachable")

    async def start(self, state, request: Request, rid: str, prepared, trace: Trace = NO_TRACE) -> asyncio.Queue:
        """The request's sink, returned with Accepted on it as soon as the prefill server opened the room
        (its /pd/transfer answer's headers are in), while the prompt still computes there: a streamed
        answer opens now, as the colocated server's does at admission, so the client's and the router's
        response starts are off the first token's path. `_first_then_admit` puts the first token (the
        prefill side's, computed from its own KV) on the sink when its line comes, then lands, checks and
        admits the KV, which the engine's tokens (2 on) wait for. What fails before the room is open is
        an error status; what fails after it reaches the client through the sink (`Failed`)."""
        room, prefill = request.headers.get(ROOM_HEADER), request.headers.get(BOOTSTRAP_HEADER)
        if not room or not prefill:
            raise bad_request("this is a PD decode server: requests come through `python -m runtime.router` "
                              f"({ROOM_HEADER} / {BOOTSTRAP_HEADER} headers missing)")
        ids = prepared.prompt_ids
        num_pages = self.engine.pool.pages_for_tokens(len(ids))

        def reserve(engine: Engine) -> list[int]:
            return engine.pool.allocate(rid, num_pages)

        # The receive slot first, so no page is held while waiting for staging space.
        staging = await self._reserve_staging(room, num_pages)
        trace.mark("staging_reserved")
        reserving = state.bridge.call(reserve)
        try:
            pages = await asyncio.shield(reserving)  # a cancelled request still learns what was allocated
        except OutOfPagesError as exc:
            self._free_staging(staging)
            raise ApiError(503, f"decode server out of KV pages: {exc}", type="server_error",
                           code="pd_out_of_pages") from None
        except BaseException:  # cancelled (server shutdown): what the engine thread allocates goes back
            self._free_staging(staging)
            reserving.add_done_callback(lambda reserved: self._unreserve(state, rid, reserved))
            raise
        self.metrics.pages_in_flight.inc(len(pages))
        trace.mark("pages_reserved")
        handed_over = False  # to `_first_then_admit`, which frees what this does not
        link = RoomLink(prefill, room)
        try:
            started = asyncio.get_running_loop().time()
            answer = await self._transfer(link, pages, staging, trace)
            sink: asyncio.Queue = asyncio.Queue()
            sink.put_nowait(Accepted(len(ids)))
            state.bridge.announce_prefilled(rid)  # the client may abort it from now on, before its admission
            self._spawn(self._first_then_admit(state, rid, ids, prepared.params, pages, answer, started, staging,
                                               sink, trace), self._verifying)
            handed_over = True
            trace.mark("stream_opened")
            return sink
        finally:
            if not handed_over:
                self._give_up(state, rid, pages, staging, link, "given up before its room was open")

    async def _transfer(self, link: RoomLink, pages: list[int], staging: int | None, trace: Trace) -> TransferAnswer:
        """The room's /pd/transfer answer, open (its lines still to be read)."""
        try:
            return await self._open_room(link, pages, staging, trace)
        except UpstreamError as exc:
            raise _unreachable(link, exc) from None

    async def _first_then_admit(self, state, rid: str, ids: list[int], params, pages: list[int],
                                answer: TransferAnswer, started: float, staging: int | None, sink: asyncio.Queue,
                                trace: Trace) -> None:
        """The answer's first line (the prompt's outcome), whose token goes onto the client's sink at once,
        then the KV (`_verify_then_admit`). Failing before the first token (the prefill side's error line,
        its answer broken off, a malformed line), the client gets the error and the request is given up
        as one that never got its first token: the room hung up on (which fails it on the prefill side),
        its pages back once the prefill side can no longer write into them. Cancelled only at shutdown."""
        try:
            try:
                first = await answer.line("first")
            except UpstreamError as exc:
                raise _unreachable(answer.link, exc) from None
            trace.mark("first_answered")
            req = prefilled_request(rid, ids, params, pages, first)  # the line's fields, validated
        except BaseException as exc:
            await answer.aclose()
            state.bridge.withdraw(rid)
            self._give_up(state, rid, pages, staging, answer.link, "given up before its first token was out")
            if isinstance(exc, ApiError):
                sink.put_nowait(Failed(exc))
            elif isinstance(exc, Exception):  # a bug: the client, its stream open, must get an error, not a hang
                log.exception("room %s: reading the prompt's outcome failed", answer.link.room)
                sink.put_nowait(Failed(ApiError(500, f"reading the prompt's outcome failed: {exc!r}",
                                                type="server_error")))
            else:
                raise
            return
        sink.put_nowait(self._first_token(req, trace, relayed=first.get("relayed") is True))
        await self._verify_then_admit(state, answer.link.room, req, answer, started, staging, sink, trace)

    def _first_token(self, req: EngineRequest, trace: Trace, relayed: bool = False) -> TokenOut:
        """The request's first token, for its client: the prefill side computed it from its own KV, so it
        does not depend on the transferred copy and goes out before the check. Whether it ends the
        request (max_tokens=1, EOS, a stop) is decided here, on the event loop, from the request and what
        the engine fixed when it was built (tokenizer, length limit): the scheduler is the engine
        thread's, and does not have the request yet. `relayed`: the prefill server relayed the token's
        chunk to the client itself (runtime/disagg/protocol.py), so the stream writes only what follows."""
        tokenizer = self.engine.tokenizer
        reason = stop_reason(req, tokenizer, self.engine.cfg.max_model_len)
        token = req.output_ids[0]
        trace.mark("first_token")
        return TokenOut(token, req.output_logprobs[0] if req.output_logprobs else 0.0,
                        req.output_top_logprobs[0] if req.output_top_logprobs else [], reason,
                        is_stop_token(req, token, reason, tokenizer.eos_token_id), relayed)

    def _spawn(self, work: Coroutine[Any, Any, None], tasks: set[asyncio.Task]) -> None:
        """Run `work` beside the request's stream, kept in `tasks` until done (the loop keeps weak
        references only; `aclose` ends what is left)."""
        task = asyncio.get_running_loop().create_task(work)
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    async def _verify_then_admit(self, state, room: str, req: EngineRequest, answer: TransferAnswer, started: float,
                                 staging: int | None, sink: asyncio.Queue, trace: Trace) -> None:
        """Wait for the prefill side's word that the KV is written (the answer's second line), land the
        staged KV (the `_lander` call), compare its digest with the sender's and admit the request; on a
        failed transfer, a mismatch (or any failure) the client's stream, whose first token is out, ends
        with the error. Never cancelled by a client that leaves: its abort is kept by the bridge until the
        admission (`announce_prefilled`), so every path here ends in admission or in freeing the pages."""
        admitted = False
        try:
            try:
                result = await answer.line("done")
            except UpstreamError as exc:
                raise ApiError(502, f"room {room}: the prefill server's answer broke off: {exc!r}",
                               type="server_error", code="pd_prefill_unreachable") from None
            finally:
                await answer.aclose()
            self.metrics.transfer_seconds.observe(asyncio.get_running_loop().time() - started)
            trace.mark("transfer_answered")
            landing = state.bridge.call(self._lander(req.pages, staging, trace))
            await self._check_kv(room, req.pages, len(req.prompt_ids), landing, result, trace)
            self.metrics.transfer_bytes.inc(int(result["kv_bytes"]))
            self.metrics.transfers.labels("ok").inc()
            state.bridge.submit_prefilled(req, sink, trace)
            admitted = True
        except ApiError as exc:
            sink.put_nowait(Failed(exc))
        except Exception as exc:  # a bug: the client, its first token out, must get an error, not a hang
            log.exception("room %s: the KV check failed", room)
            sink.put_nowait(Failed(ApiError(500, f"the KV check failed: {exc!r}", type="server_error")))
        finally:
            if admitted:
                self._release(state, req.rid, req.pages, staging, admitted=True)
            else:
                state.bridge.withdraw(req.rid)
                self._give_up(state, req.rid, req.pages, staging, answer.link, "gave up waiting for its KV")

    def _lander(self, pages: list[int], staging: int | None,
                trace: Trace) -> Callable[[Engine], torch.cuda.Event | None]:
        """What lands the staged KV, for the engine thread (`EngineBridge.call`)."""
        def land(engine: Engine) -> torch.cuda.Event | None:
            """On the engine thread, as every other write to the pool: staged KV into the pages. On a
            GPU pool, an event marks where the copies stand in the engine's stream."""
            if staging is not None:
                self.transfer.receive_staged(staging, pages)
            trace.mark("kv_landed")
            return _stream_mark(self.transfer.latent)

        return land

    async def _check_kv(self, room: str, pages: list[int], num_tokens: int, landing: asyncio.Future, result: dict,
                        trace: Trace) -> None:
        """Once the KV has landed (`landing`), raise pd_kv_corrupt unless what the pages hold has the
        sender's digest (worker thread)."""
        page_size = self.engine.pool.page_size

        def check(landed: torch.cuda.Event | None) -> str:
            """The digest of what the pages hold, on a worker thread: the engine thread is the busy
            decode server's bottleneck (2.3 ms of it per PD request on the H200 when it hashed there).
            Nothing writes these pages before the request is admitted, which waits for this."""
            if landed is not None:
                landed.synchronize()
            digest = kv_digest(self.transfer.latent, self.transfer.index_keys, pages, page_size, num_tokens)
            trace.mark("kv_checked")
            return digest

        landed = await landing
        digest = await asyncio.get_running_loop().run_in_executor(self._digests, check, landed)
        if digest != result["digest"]:
            self.metrics.transfers.labels("corrupt").inc()
            raise ApiError(502, f"room {room}: the KV arrived corrupted (digest {digest} != sender's "
                                f"{result['digest']})", type="server_error", code="pd_kv_corrupt")

    def _give_up(self, state, rid: str, pages: list[int], staging: int | None, link: RoomLink, reason: str) -> None:
        """The request ends without admission: its pages and receive slot go back at once when the
        prefill side cannot write into them any more (it never had the room, refused it, or its answer's
        last line is in), else once it confirmed that (`_close_then_release`, beside the client's error)."""
        if link.may_write:
            self._spawn(self._close_then_release(state, rid, pages, staging, link, reason), self._closing)
        else:
            self._release(state, rid, pages, staging, admitted=False)

    async def _close_then_release(self, state, rid: str, pages: list[int], staging: int | None, link: RoomLink,
                                  reason: str) -> None:
        """Close the room on its prefill server, then free its pages and receive slot: a KV write the
        prefill side had in progress when the room was given up would otherwise land in them after
        another request got them. No confirmation within the PD timeout (the prefill server hangs,
        answers an error, or the network is cut): they stay out of the pools (`_quarantine`) until a
        retried close is confirmed."""
        outcome = "unconfirmed"
        try:
            outcome = await self._close_room(link, reason)
            self.metrics.room_closes.labels(outcome).inc()
            if outcome == "refused":
                await asyncio.sleep(REFUSED_SETTLE_S)
        except asyncio.CancelledError:  # server shutdown (`aclose`): the engine has stopped
            outcome = "shutdown"
            raise
        finally:
            if outcome in RELEASING_OUTCOMES or outcome == "shutdown":
                self._release(state, rid, pages, staging, admitted=False)
            else:
                self._quarantine(state, Quarantined(rid, pages, staging, link, reason), outcome)

    async def _close_room(self, link: RoomLink, reason: str, level: int = logging.ERROR) -> str:
        """POST /pd/rooms/{room}/close, bounded by the PD timeout: "closed" once the prefill side barred
        every write into the room, "refused" when nothing listens there, "no_route" when the prefill
        server has no such route (an older version: 404), "unconfirmed" otherwise. A close that fails
        is logged at `level` (retries log theirs quietly)."""
        try:
            status, content = await asyncio.wait_for(self._post_close(link, reason), self.timeout_s)
        except UpstreamConnectError:
            # Connection refused: no process listens, so no handler of the room runs and no write can
            # start. What a dead sender put on the wire before it died may still be copied into our
            # memory by our own transfer engine's receiving thread (TCP), for a moment: hence the
            # settle delay before the pages go back (REFUSED_SETTLE_S).
            return "refused"
        except (UpstreamError, TimeoutError) as exc:
            log.log(level, "room %s: closing it on %s failed: %r", link.room, link.prefill, exc)
            return "unconfirmed"
        if status == 404:
            self._report_no_close_route(link.prefill, "POST /pd/rooms/{room}/close answered 404")
            return "no_route"
        if status != 200:
            log.log(level, "room %s: %s answered the close with HTTP %d: %s", link.room, link.prefill,
                    status, content[:300].decode(errors="replace"))
            return "unconfirmed"
        self._no_close_route.discard(link.prefill)  # upgraded: a downgrade is reported again
        return "closed"

    def _report_no_close_route(self, prefill: str, evidence: str) -> None:
        """Say once per prefill server (per process) that it is too old to confirm a close, and what that
        costs: every room given up while it may write stays quarantined."""
        if prefill in self._no_close_route:
            return
        self._no_close_route.add(prefill)
        log.error("prefill server %s has no room-close route (%s): upgrade it. Until then the KV pages and "
                  "staging slot of every room given up while it may still write into them stay quarantined "
                  "(dsv4_pd_quarantined_pages): nothing else rules out a late write. Their close is tried again "
                  "every %g s", prefill, evidence, QUARANTINE_RETRY_MAX_S)

    async def _post_close(self, link: RoomLink, reason: str) -> tuple[int, bytes]:
        """The close call's status and body, sent again once when the connection it went out on broke: a
        pooled connection to a server that died meanwhile breaks on use, where a new one is refused."""
        url, body = f"{link.prefill}/pd/rooms/{link.room}/close", {"name": self.name, "reason": reason}
        for attempt in range(2):  # idempotent: closing a closed room answers at once, so a second try is safe
            try:
                reply = await self.client().request("POST", url, json_body=body)
                return reply.status_code, await reply.aread()
            except UpstreamConnectError:
                raise  # nothing listens: "refused", no second try
            except UpstreamError:
                if attempt:
                    raise
        raise AssertionError("unreachable: the second try returns or raises")

    def _quarantine(self, state, room: Quarantined, outcome: str) -> None:
        """Keep a given-up room's pages (owned by its rid in the pool) and receive slot out of the pools:
        a late KV write may still land in them, and memory lost for a while is better than another
        request's KV corrupted, silently in direct mode. Counted in /metrics, logged; the close is
        retried (`_retry_quarantined`) until it is confirmed or the server shuts down."""
        self.metrics.pages_in_flight.dec(len(room.pages))
        self.metrics.quarantined_pages.inc(len(room.pages))
        if room.staging is not None:
            self.metrics.quarantined_staging_slots.inc()
        log.error("room %s: prefill server %s did not confirm that no KV write can land in the room any more "
                  "(%s): its %d KV pages%s stay out of the pool until a later close is confirmed "
                  "(dsv4_pd_quarantined_pages)", room.link.room, room.link.prefill, outcome, len(room.pages),
                  "" if room.staging is None else " and its staging slot")
        if not self._stopping:
            self._spawn(self._retry_quarantined(state, room, outcome), self._retrying)

    async def _retry_quarantined(self, state, room: Quarantined, outcome: str) -> None:
        """Send a quarantined room's close again, waiting longer each time (`next_retry_wait`), until it
        is confirmed or refused, then lift the quarantine. Cancelled at shutdown, it frees nothing."""
        waits = retry_waits(QUARANTINE_RETRY_FIRST_S, QUARANTINE_RETRY_GROWTH, QUARANTINE_RETRY_MAX_S)
        while outcome not in RELEASING_OUTCOMES:
            await asyncio.sleep(next_retry_wait(outcome, waits))
            outcome = await self._close_room(room.link, room.reason, level=logging.DEBUG)
            room.tries += 1
        if outcome == "refused":
            await asyncio.sleep(REFUSED_SETTLE_S)
        self._lift_quarantine(state, room, outcome)

    def _lift_quarantine(self, state, room: Quarantined, outcome: str) -> None:
        """A retried close ruled out any late write: the room's pages and receive slot go back."""
        self.metrics.quarantined_pages.dec(len(room.pages))
        if room.staging is not None:
            self.metrics.quarantined_staging_slots.dec()
        self._free_staging(room.staging)
        state.bridge.call(lambda engine: engine.pool.free(room.rid, room.pages))
        self.metrics.quarantines_lifted.labels(outcome).inc()
        log.warning("room %s: prefill server %s %s its close on retry %d: the quarantine is lifted, its %d KV "
                    "pages%s are back", room.link.room, room.link.prefill,
                    "confirmed" if outcome == "closed" else "refused", room.tries, len(room.pages),
                    "" if room.staging is None else " and its staging slot")

    def _release(self, state, rid: str, pages: list[int], staging: int | None, admitted: bool) -> None:
        """The request's KV is no longer in flight: its receive slot goes back (the KV is in the pages or
        no longer wanted), and its pages too unless the engine has them now."""
        self.metrics.pages_in_flight.dec(len(pages))
        if admitted or not self.faults.enabled("pd-abort-leak"):  # the fault: a given-up request's slot leaks
            self._free_staging(staging)
        if not admitted and not self.faults.enabled("pd-abort-leak"):  # the fault: reserved pages leak
            state.bridge.call(lambda engine: engine.pool.free(rid, pages))

    def _unreserve(self, state, rid: str, reserved: asyncio.Future) -> None:
        """Free the pages of a reservation made for a request given up while it was queued."""
        if not reserved.cancelled() and reserved.exception() is None:
            pages = reserved.result()
            state.bridge.call(lambda engine: engine.pool.free(rid, pages))

    async def _reserve_staging(self, room: str, num_pages: int) -> int | None:
        """A receive slot for `num_pages` pages of KV (staged mode; None in direct mode), waiting for
        slots of other requests to be freed up to the PD timeout. A request cancelled while it waits
        holds nothing (`StagingArena.allocate_async`)."""
        arena = self.transfer.staging
        if arena is None:
            return None
        nbytes = self.transfer.staged_bytes(num_pages)
        if nbytes > arena.capacity:
            raise ApiError(503, f"room {room}: its KV ({nbytes} bytes) exceeds the decode server's staging "
                                f"arena ({arena.capacity} bytes)", type="server_error", code="pd_out_of_staging")
        offset = await arena.allocate_async(nbytes, self.timeout_s)
        if offset is None:
            raise ApiError(503, f"room {room}: no staging space for {nbytes} bytes of KV came free within "
                                f"{self.timeout_s:g} s", type="server_error", code="pd_out_of_staging")
        return offset

    def _free_staging(self, offset: int | None) -> None:
        if offset is not None:
            assert self.transfer.staging is not None
            self.transfer.staging.free(offset)


@dataclass
class RoomLink:
    """A request's room at its prefill server, as far as the decode side's pages are concerned."""

    prefill: str  # the prefill server's base URL
    room: str
    # Whether the prefill side may (still) write into the room's pages and receive slot: set as the
    # /pd/transfer call goes out, cleared when the prefill side refuses the room or its answer's last
    # line is in (the KV written, or the room failed, which bars writes first: BootstrapRegistry.fail).
    may_write: bool = False


@dataclass
class Quarantined:
    """A given-up room whose pages and receive slot are kept out of the pools until its close is
    confirmed (`DecodeSide._quarantine`)."""

    rid: str  # the request's id: its pages are owned by it in the pool
    pages: list[int]
    staging: int | None
    link: RoomLink
    reason: str  # why it was given up: sent with each close
    tries: int = 0  # retried closes so far


def retry_waits(first_s: float, growth: float, max_s: float) -> Iterator[float]:
    """The waits before each retried close: `first_s`, then each `growth` times the last, never over
    `max_s`; endless."""
    wait = min(first_s, max_s)
    while True:
        yield wait
        wait = min(wait * growth, max_s)


def next_retry_wait(outcome: str, waits: Iterator[float], rand: Callable[[], float] = random.random) -> float:
    """The wait before retrying a close that ended in `outcome`: the next of `waits`, or the longest at
    once after a "no_route" (a missing route comes only with an upgrade, not within seconds), less up
    to QUARANTINE_RETRY_JITTER of it (`rand()` in [0, 1) says how much)."""
    wait = QUARANTINE_RETRY_MAX_S if outcome == "no_route" else next(waits)
    return wait * (1.0 - QUARANTINE_RETRY_JITTER * rand())


class TransferAnswer:
    """A /pd/transfer answer being read: its JSON lines one at a time (runtime/disagg/protocol.py)."""

    def __init__(self, reply: UpstreamReply, link: RoomLink) -> None:
        self.reply, self.link = reply, link
        self._lines = reply.aiter_lines()

    async def line(self, want: str) -> dict:
        """The next line's value, which must be `want`; an error line raises its ApiError, an answer that
        ends early a pd_upstream_error."""
        async for line in self._lines:
            if line.strip():
                text = line.decode()
                parsed = parse_transfer_line(text)
                if ends_the_write(parsed):
                    self.link.may_write = False
                return transfer_value(parsed, want, text)
        raise ApiError(502, f"the /pd/transfer answer ended before its {want!r} line", type="server_error",
                       code="pd_upstream_error")

    async def aclose(self) -> None:
        await self.reply.aclose()


def prefilled_request(rid: str, ids: list[int], params, pages: list[int], result: dict) -> EngineRequest:
    """The engine request as the prefill server left it: prompt, first token, sampler state."""
    req = EngineRequest(rid, list(ids), params)
    token, logprob, top = first_token_of(result, params.logprobs)  # as the prefill side's relay reads it
    req.output_ids = [token]
    if params.logprobs:
        req.output_logprobs = [logprob]
        req.output_top_logprobs = [top]
    req.pages = list(pages)
    req.num_sampled = int(result["num_sampled"])
    assert req.generator is not None
    req.generator.set_state(torch.frombuffer(bytearray(base64.b64decode(result["generator"])), dtype=torch.uint8))
    return req


def _stream_mark(pool: torch.Tensor) -> torch.cuda.Event | None:
    """An event recorded on the current (engine) stream of a GPU pool; None on the CPU, where the
    engine thread's writes are done when it returns."""
    if pool.device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event


async def _cancel_and_wait(tasks: set[asyncio.Task]) -> None:
    """Cancel `tasks` and wait for their `finally`s (a cancelled task frees nothing until it runs),
    while the loop that runs them is certainly still here."""
    pending = list(tasks)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)


def _unreachable(link: RoomLink, exc: UpstreamError) -> ApiError:
    return ApiError(502, f"prefill server {link.prefill} unreachable for room {link.room}: {exc!r}",
                    type="server_error", code="pd_prefill_unreachable")


def _refused_the_room(status: int, body: dict) -> bool:
    """Whether a /pd/transfer error answer means the prefill side holds no room for these pages: a
    client error (nothing opened), or a room error (pd_*: the room failed, its writes barred). Any
    other server error may have come after the room opened."""
    code = body.get("error", {}).get("code") if isinstance(body.get("error"), dict) else None
    return status < 500 or str(code).startswith("pd_")


def _json(content: bytes) -> dict:
    try:
        body = json.loads(content)
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}
