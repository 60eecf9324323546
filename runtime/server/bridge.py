"""The engine thread and its bridge to the asyncio event loop.

The Engine is not thread-safe and its steps are long CPU work, so it lives on one thread of its
own: the event loop sends commands (add, abort) through a thread-safe queue and never waits on
the model; the engine thread sends each request's results back onto that request's asyncio queue
with `loop.call_soon_threadsafe`, once per step for all of the step's events (one wake-up of the
loop, not one per token: at 80 streams the per-call wake-ups were a share of the loop's time that
grew with the batch). Finished requests are dropped from the scheduler's table so a
long-running server does not accumulate them.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from runtime.engine.engine import Engine, StepResult
from runtime.engine.request import Request, SamplingParams
from runtime.server.errors import ApiError, rejected
from runtime.server.metrics import ServerMetrics
from runtime.server.trace import NO_TRACE, Trace

log = logging.getLogger(__name__)
IDLE_WAIT_S = 0.05


@dataclass(frozen=True)
class Accepted:
    prompt_tokens: int


@dataclass(frozen=True)
class Rejected:
    message: str


@dataclass(frozen=True)
class TokenOut:
    token: int
    logprob: float
    top: list[tuple[int, float]]
    finish_reason: str | None  # set on the request's last token
    is_stop_token: bool  # EOS or a stop_token_id: counted, not shown as text
    # PD decode: the prefill server relayed this first token's chunk, and the opening, to the client
    # through the router (runtime/disagg/protocol.py); the stream writes RELAYED_EVENT in their place.
    relayed: bool = False


@dataclass(frozen=True)
class Aborted:
    """The request ended without a token this step (client disconnect)."""


@dataclass(frozen=True)
class Failed:
    """The request failed after its first token was sent (PD decode: its KV arrived corrupted, or the
    engine refused it): a stream reports `error` inside itself, a unary request answers with it."""
    error: ApiError


Event = Accepted | Rejected | TokenOut | Aborted | Failed


def is_stop_token(req: Request, token: int, reason: str | None, eos_token_id: int) -> bool:
    """The request's last token is EOS or a stop_token_id that ended it: counted, not shown as text."""
    return reason == "stop" and isinstance(req.matched_stop, int) and (
        token == eos_token_id or token in req.params.stop_token_ids)


class EngineBridge:
    def __init__(self, engine: Engine, metrics: ServerMetrics) -> None:
        self.engine = engine
        self.metrics = metrics
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._sinks: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._outbox: list[tuple[tuple[asyncio.AbstractEventLoop, asyncio.Queue], Event]] = []
        # Traced requests until their first token (runtime/server/trace.py); empty when nobody traces,
        # and then the step's loop does not look at it.
        self._traces: dict[str, Trace] = {}
        # PD decode requests whose first token is out before the engine has them (`announce_prefilled`):
        # rid -> the reason of an abort asked for meanwhile (None: none yet). Event-loop side only.
        self._announced: dict[str, str | None] = {}
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        # Set when the engine thread ends (`stop`, or the engine died), under `_closing`: a `call` queued
        # before it is still run by that thread, one made after it is run by its caller.
        self._closing = threading.Lock()
        self._closed = False
        self.error: BaseException | None = None  # set if the engine thread died
        # PD prefill (runtime/disagg/prefill.py): sees every step's result on the engine thread, before
        # the next step is planned (its requests' KV pages are kept: `submit(keep_pages=True)`).
        self.on_step: Callable[[StepResult], None] | None = None
        self._preemptions = 0  # the scheduler's count the counter last caught up with
        self._hit_tokens = self._lookup_tokens = 0  # the prefix cache's counts the counters caught up with
        metrics.kv_pages_total.set(engine.pool.num_pages)

    # ---- event-loop side ------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=10)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def submit(self, rid: str, prompt_ids: list[int], params: SamplingParams, *,
               keep_pages: bool = False, trace: Trace = NO_TRACE) -> asyncio.Queue:
        """Queue a request; its events (Accepted or Rejected first) arrive on the returned queue.
        `keep_pages`: its pages outlive it, for the caller to free (`Engine.add_request`). `trace` gets
        the engine thread's marks: accepted, its first step started, its first token."""
        sink: asyncio.Queue = asyncio.Queue()
        self._commands.put(("add", rid, prompt_ids, params, keep_pages, (asyncio.get_running_loop(), sink), trace))
        self._wake.set()
        return sink

    def announce_prefilled(self, rid: str) -> None:
        """PD decode: `rid`'s first token goes to its client before the engine has the request (its KV
        is still being checked, runtime/disagg/decode.py), so its client may abort it first. Such an
        abort is kept here and sent right after the admission (`submit_prefilled`): the engine, not
        knowing the rid yet, would drop it, and the request would then decode for nobody."""
        self._announced[rid] = None

    def withdraw(self, rid: str) -> None:
        """PD decode: the announced request will not be admitted (its KV check failed): forget it and
        any abort kept for it (its caller frees its pages)."""
        self._announced.pop(rid, None)

    def submit_prefilled(self, req: Request, sink: asyncio.Queue, trace: Trace = NO_TRACE) -> None:
        """PD decode: queue a request whose prompt KV is already in its pages and whose first token is
        in `output_ids`, Accepted and that token already put on `sink` by the caller; the engine sends
        what follows (or Failed, if it refuses the request), and an abort kept since
        `announce_prefilled` right after it."""
        deferred_abort = self._announced.pop(req.rid, None)
        self._commands.put(("admit", req, (asyncio.get_running_loop(), sink), trace))
        if deferred_abort is not None:
            self._commands.put(("abort", req.rid, deferred_abort))
        self._wake.set()

    def call(self, fn: Callable[[Engine], Any]) -> asyncio.Future:
        """Run `fn(engine)` on the engine thread (the pool and KV are not thread-safe); await its result.
        Once that thread has ended, on the caller: the engine has no other user then, and what a caller
        gives back at shutdown (a PD request's reserved pages) must still reach the pool."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._closing:
            if not self._closed:
                self._commands.put(("call", fn, loop, future))
                self._wake.set()
                return future
        _settle(future, *_outcome(fn, self.engine))
        return future

    def abort(self, rid: str, reason: str = "abort") -> None:
        """End the request at the next step; `reason` as `Scheduler.abort` takes it."""
        if rid in self._announced:  # not in the engine yet: sent once it is (`submit_prefilled`)
            if self._announced[rid] is None:
                self._announced[rid] = reason
            return
        self._commands.put(("abort", rid, reason))
        self._wake.set()

    # ---- engine thread --------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain_commands()
                self._flush()
                if not self.engine.has_work:
                    self._wake.wait(IDLE_WAIT_S)
                    self._wake.clear()
                    continue
                self._step()
                self._flush()
            self._close()
            self._drain_commands()  # those queued before `stop()`: a PD side's last frees among them
            self._flush()
        except BaseException as exc:  # the server must report a dead engine, not hang its clients
            self._close()
            log.exception("engine thread died")
            self.error = exc
            self._outbox.clear()  # a half-sent step: its clients get the failure instead
            for rid in list(self._sinks):
                self._send(rid, Rejected(f"engine failure: {exc}"))
            self._flush()

    def _close(self) -> None:
        with self._closing:
            self._closed = True

    def _drain_commands(self) -> None:
        drained = False
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                if drained:  # PD commands allocate and free (or cache) pages outside any step: keep the gauges true
                    self.metrics.kv_pages.set(self.engine.pages_in_use)
                    self._cache_metrics()
                return
            drained = True
            if command[0] == "add":
                _, rid, prompt_ids, params, keep_pages, sink, trace = command
                trace.mark("engine_accepted")
                self._sinks[rid] = sink
                try:
                    self.engine.add_request(prompt_ids, params, rid=rid, keep_pages=keep_pages)
                except ValueError as exc:  # RequestRejected and out-of-vocabulary prompts
                    self._send(rid, Rejected(str(exc)))
                    del self._sinks[rid]
                    continue
                self.metrics.prompt_tokens.inc(len(prompt_ids))
                self._send(rid, Accepted(len(prompt_ids)))
                if trace is not NO_TRACE:
                    self._traces[rid] = trace
            elif command[0] == "abort":
                self.engine.abort(command[1], command[2])
            elif command[0] == "admit":
                self._admit(*command[1:])
            elif command[0] == "call":
                _, fn, loop, future = command
                loop.call_soon_threadsafe(_settle, future, *_outcome(fn, self.engine))

    def _admit(self, req: Request, sink: tuple[asyncio.AbstractEventLoop, asyncio.Queue], trace: Trace) -> None:
        trace.mark("engine_accepted")
        self._sinks[req.rid] = sink
        try:
            reason = self.engine.admit_prefilled(req)
        except ValueError as exc:  # over a limit: its reserved pages go back, the client gets the reason
            if req.rid not in self.engine.scheduler.requests:
                self.engine.pool.free(req.rid, req.pages)
            self._send(req.rid, Failed(rejected(str(exc))))  # after its first token: a Failed, not a Rejected
            del self._sinks[req.rid]
            return
        self.metrics.prompt_tokens.inc(len(req.prompt_ids))
        if reason is not None:  # the first token already ended it: nothing left for the loop
            self.metrics.finished.labels(reason).inc()
            self._sinks.pop(req.rid, None)

    def _step(self) -> None:
        started = time.monotonic()
        result = self.engine.step()
        if self.on_step is not None:
            self.on_step(result)
        if self._traces:
            self._mark_traces(result, started)
        requests = self.engine.scheduler.requests
        eos = self.engine.tokenizer.eos_token_id
        for rid, out in result.outputs.items():
            req = requests[rid]
            # postprocess() never extends a finished request, so a finished one just produced its last token.
            reason = req.finish_reason if req.finished else None
            stop_token = is_stop_token(req, out.token, reason, eos)
            self._send(rid, TokenOut(out.token, out.logprob, out.top, reason, stop_token))
        self.metrics.generated_tokens.inc(len(result.outputs))
        for req in result.finished:
            if req.finish_reason == "abort":
                self._send(req.rid, Aborted())
            self.metrics.finished.labels(req.finish_reason).inc()
            self._sinks.pop(req.rid, None)
            requests.pop(req.rid, None)
        self.metrics.step_seconds.observe(result.seconds)
        self.metrics.running.set(len(self.engine.scheduler.running))
        self.metrics.waiting.set(len(self.engine.scheduler.waiting))
        self.metrics.kv_pages.set(self.engine.pages_in_use)
        self._cache_metrics()
        preemptions = self.engine.scheduler.num_preemptions
        self.metrics.preemptions.inc(preemptions - self._preemptions)
        self._preemptions = preemptions

    def _cache_metrics(self) -> None:
        cache = self.engine.prefix_cache
        if cache is None:
            return
        self.metrics.kv_pages_cached.set(cache.num_pages)
        self.metrics.prefix_hit_tokens.inc(cache.hit_tokens - self._hit_tokens)
        self.metrics.prefix_lookup_tokens.inc(cache.lookup_tokens - self._lookup_tokens)
        self._hit_tokens, self._lookup_tokens = cache.hit_tokens, cache.lookup_tokens

    def _mark_traces(self, result: StepResult, started: float) -> None:
        """A traced request's first scheduled step (the overlap loop reports a step's plan with its
        outputs one step later, except the first of a burst: exact for a request alone) and its first
        token; the trace is let go after that, or when the request ends without one."""
        for extend in result.plan.prefill:
            trace = self._traces.get(extend.rid)
            if trace is not None and "step_started" not in trace.marks:
                trace.marks["step_started"] = started
        for rid in result.outputs:
            trace = self._traces.pop(rid, None)
            if trace is not None:
                trace.mark("first_token")
        for req in result.finished:
            self._traces.pop(req.rid, None)

    def _send(self, rid: str, event: Event) -> None:
        sink = self._sinks.get(rid)
        if sink is not None:
            self._outbox.append((sink, event))

    def _flush(self) -> None:
        """Hand the queued events to their event loops: one callback per loop, events in order."""
        if not self._outbox:
            return
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Event]]] = {}
        for (loop, q), event in self._outbox:
            by_loop.setdefault(loop, []).append((q, event))
        self._outbox = []
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # the loop is closed (server shutting down)
                pass


def _outcome(fn: Callable[[Engine], Any], engine: Engine) -> tuple[Any, bool]:
    """`fn(engine)`'s result, or the exception it raised (the caller's error, not the engine's: handed
    back), and whether it raised."""
    try:
        return fn(engine), False
    except Exception as exc:
        return exc, True


def _settle(future: asyncio.Future, outcome: Any, failed: bool) -> None:
    if future.done():  # the awaiting coroutine was cancelled
        return
    if failed:
        future.set_exception(outcome)
    else:
        future.set_result(outcome)


def _deliver(items: list[tuple[asyncio.Queue, Event]]) -> None:
    for q, event in items:
        q.put_nowait(event)
