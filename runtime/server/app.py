"""The FastAPI application: OpenAI-compatible chat completions over the engine bridge.

Handlers validate everything before the engine sees a request (bad input is a 4xx with an
OpenAI-shaped body), render the chat template, submit through the bridge and turn engine tokens
into a response with `ChoiceBuilder`. A stream that loses its client aborts its request, so the
request's KV pages return to the pool. Authentication and admission limits are ASGI middleware in
front of the router (runtime/server/auth.py, limits.py), so no route can forget them.
"""

from __future__ import annotations

import asyncio
import logging
import platform
import random
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Scope

from runtime.disagg.protocol import RELAYED_EVENT, ROOM_HEADER, completion_id, created_of
from runtime.engine.engine import Engine
from runtime.engine.request import SamplingParams
from runtime.env import Env
from runtime.models.loader import LoadedModel
from runtime.server import dsml
from runtime.server.auth import BearerAuth
from runtime.server.bridge import Aborted, Accepted, EngineBridge, Failed, Rejected, TokenOut
from runtime.server.chat_template import ChatTemplate, TemplateError, call_opening
from runtime.server.corrupt import ToolJsonCorruptor, request_key
from runtime.server.errors import ApiError, bad_request, from_validation_errors, rejected, sse_event
from runtime.server.http_stack import event_loop_name
from runtime.server.internal_errors import InternalErrors
from runtime.server.limits import ConcurrencyLimit, HeaderSizeLimit, RequestSlots
from runtime.server.metrics import ServerMetrics
from runtime.server.output import ChoiceBuilder, Delta, OutputOptions, fold
from runtime.server.prompt import render_prompt
from runtime.server.protocol import ChatCompletionRequest, Message, NamedToolChoice
from runtime.server.request_body import check_content_type, decode_json, read_limited, until_disconnected
from runtime.server.sse import ChunkEncoder, delta_body
from runtime.server.trace import NO_TRACE, Trace, TraceLog

log = logging.getLogger(__name__)
CLIENT_GONE = object()  # put into a unary request's sink when its client disconnects
CHAT_PATH = "/v1/chat/completions"
GENERATION_PATHS = frozenset({CHAT_PATH})  # the routes that hold engine work, hence a concurrency slot


@dataclass
class ServerState:
    loaded: LoadedModel
    engine: Engine
    template: ChatTemplate
    env: Env
    api_key: str | None = None
    max_concurrent_requests: int | None = None  # None: env.server_max_concurrent
    pd: Any = None  # PD disaggregation: runtime/disagg PrefillSide or DecodeSide; None = colocated

    def __post_init__(self) -> None:
        self.metrics = ServerMetrics()
        self.bridge = EngineBridge(self.engine, self.metrics)
        self.slots = RequestSlots(self.max_concurrent_requests or self.env.server_max_concurrent,
                                  self.metrics.in_flight.set)
        self.model_name = self.loaded.name
        self.model_hash = self.loaded.weights_hash
        self.traces = TraceLog()  # requests that asked for one (runtime/server/trace.py)
        if self.pd is not None:
            self.pd.metrics.attach(self.metrics.registry)
            if self.pd.mode == "prefill":
                self.bridge.on_step = self.pd.on_step


def create_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI):
        state.bridge.start()
        yield
        state.bridge.stop()
        if state.pd is not None:
            await state.pd.aclose()  # the decode side's HTTP client to the prefill servers
            state.pd.transfer.close()  # unregister the KV pool: a peer's late write is refused, not a stray store

    app = FastAPI(title="dsv4 runtime", lifespan=lifespan)
    app.state.server = state
    route_paths: set[str] = set()  # filled once the routes exist, below

    def count(scope: Scope, status: int) -> None:
        # Label by route, not by raw path: a scanner's random paths must not grow the registry.
        path = scope["path"] if scope["path"] in route_paths else "unmatched"
        state.metrics.requests.labels(path, str(status)).inc()

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> Response:
        count(request.scope, exc.status)
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> Response:
        return await _api_error(request, from_validation_errors(list(exc.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        code = "not_found" if exc.status_code == 404 else None
        return await _api_error(request, ApiError(exc.status_code, str(exc.detail), code=code,
                                                  headers=dict(exc.headers) if exc.headers else None))

    @app.get("/health")
    async def health() -> Response:
        if not state.bridge.alive:
            # No detail on the one open route: the cause is in the log and in /server_info (keyed).
            return JSONResponse({"status": "engine down"}, status_code=503)
        if state.pd is not None and state.pd.draining:
            # A prefill server draining for a shutdown takes no new prompt: a router's health poll
            # passes it over before any request is refused (runtime/router_health.py).
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/server_info")
    async def server_info() -> dict:
        import fastapi
        import torch

        return {"model": state.model_name, "model_hash": state.model_hash,
                "config_fingerprint": state.loaded.config.fingerprint,
                "model_config": state.loaded.config.to_dict(), "engine_config": asdict(state.engine.cfg),
                # What the config leaves to the engine, and another speed each (the gate's perf key):
                # the prefix cache as resolved, and the server's PD role (None: colocated).
                "prefix_cache": getattr(state.engine, "prefix_cache", None) is not None,
                "disaggregation": getattr(state.engine, "disaggregation", None),
                "faults": list(state.engine.faults.names), "chat_template": state.template.origin,
                "device_name": (torch.cuda.get_device_name(state.engine.cfg.device)
                                if state.engine.cfg.device != "cpu" else "cpu"),
                "versions": {"python": platform.python_version(), "torch": torch.__version__,
                             "fastapi": fastapi.__version__},
                "event_loop": event_loop_name(),  # runtime/server/http_stack.py
                "engine_error": None if state.bridge.error is None else repr(state.bridge.error)}

    @app.get("/debug/trace/{key}")
    async def debug_trace(key: str) -> dict:
        """The phase marks of a request that sent `x-dsv4-trace: KEY` (runtime/server/trace.py)."""
        marks = state.traces.marks(key)
        if marks is None:
            raise ApiError(404, f"no trace {key!r} is kept here", code="not_found")
        return {"marks": marks}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": 0,
                                            "owned_by": "dsv4-runtime",
                                            "max_model_len": state.engine.cfg.max_model_len}]}

    @app.post(CHAT_PATH)
    async def chat_completions(request: Request) -> Response:
        trace = state.traces.start(request.headers)
        trace.mark("received")
        req = await _parse_body(request, state.env.server_max_body_bytes, trace)
        trace.mark("parsed")
        trace.mark_cpu("parsed")
        prepared = _prepare(state, req)
        trace.mark_cpu("prepared")
        trace.mark("prepared")
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        # Prompts are user data: only at debug level, which an operator switches on deliberately.
        log.debug("%s: %d prompt tokens: %r", rid, len(prepared.prompt_ids), prepared.prompt)
        if state.pd is not None:  # PD: prefill answers here; decode hands back the sink of a request whose room opened
            started = await state.pd.start(state, request, rid, prepared, trace)
            if isinstance(started, Response):
                state.metrics.requests.labels(request.url.path, "200").inc()
                return started
            sink = started
        else:
            sink = state.bridge.submit(rid, prepared.prompt_ids, prepared.params, trace=trace)
        first = await sink.get()
        if isinstance(first, Rejected):
            raise rejected(first.message)
        assert isinstance(first, Accepted)
        builder = ChoiceBuilder(state.engine.tokenizer, prepared.output, prepared.corruptor)
        if req.stream:
            state.metrics.requests.labels(request.url.path, "200").inc()
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            encoder = stream_encoder(state, rid, request)
            return StreamingResponse(_stream(state, rid, sink, builder, encoder, len(prepared.prompt_ids),
                                             include_usage, trace), media_type="text/event-stream")
        return await _unary(state, request, rid, sink, builder, len(prepared.prompt_ids))

    if state.pd is not None:
        state.pd.add_routes(app)
    route_paths.update(getattr(route, "path", "") for route in app.routes)
    # add_middleware wraps: the last one added runs first (headers, the key, a slot, then the 500 net).
    # A bug, not a bad input: an OpenAI-shaped 500 with an error id, innermost so a slot is still released.
    app.add_middleware(InternalErrors, on_error=count)
    app.add_middleware(ConcurrencyLimit, slots=state.slots, paths=GENERATION_PATHS, on_reject=count)
    app.add_middleware(BearerAuth, api_key=state.api_key, on_reject=count)
    app.add_middleware(HeaderSizeLimit, on_reject=count)
    return app


# ---- request preparation ------------------------------------------------------------------------
@dataclass
class Prepared:
    prompt: str
    prompt_ids: list[int]
    params: SamplingParams
    output: OutputOptions
    corruptor: ToolJsonCorruptor | None


async def _parse_body(request: Request, limit: int, trace: Trace = NO_TRACE) -> ChatCompletionRequest:
    check_content_type(request.headers.get("content-type"))
    raw = await read_limited(request.stream(), request.headers.get("content-length"), limit)
    trace.mark("body_read")
    payload = decode_json(raw)
    if not isinstance(payload, dict):
        raise bad_request("request body must be a JSON object")
    try:
        req = ChatCompletionRequest.model_validate(payload)
    except ValidationError as exc:
        raise from_validation_errors([dict(error) for error in exc.errors()]) from None
    req.check()
    return req


def _prepare(state: ServerState, req: ChatCompletionRequest) -> Prepared:
    if req.model != state.model_name:
        raise ApiError(404, f"the model {req.model!r} does not exist; this server serves {state.model_name!r}",
                       param="model", code="model_not_found")
    mode = req.tool_choice_mode
    tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
    forced = ""
    template_choice = mode
    if isinstance(req.tool_choice, NamedToolChoice):
        # A named function is guaranteed by writing the call's opening into the prompt: the model
        # continues inside the invoke, and the parser sees the same opening first.
        name = req.tool_choice.function.name
        tools = [t for t in tools if t["function"]["name"] == name]
        forced = f'{dsml.BLOCK_OPEN}\n<{dsml.DSML}invoke name="{name}">\n'
        template_choice = "required"
    messages = [m.model_dump(exclude_none=True) for m in req.messages]
    tok = state.engine.tokenizer
    try:
        prompt = render_prompt(state.template, tok, messages, tools, template_choice, suffix=forced)
    except TemplateError as exc:
        raise bad_request(str(exc), param="messages") from None
    ids = prompt.ids
    if not ids or ids[0] != tok.bos_token_id:
        ids = [tok.bos_token_id, *ids]
    limit = state.engine.cfg.max_model_len
    if len(ids) >= limit:
        raise bad_request(f"the prompt is {len(ids)} tokens; this model's context is {limit} tokens",
                          param="messages", code="context_length_exceeded")
    max_tokens = req.requested_max_tokens or (limit - len(ids))
    if len(ids) + max_tokens > limit:
        raise bad_request(f"max_tokens={max_tokens} plus the {len(ids)}-token prompt exceeds the {limit}-token "
                          f"context", param="max_tokens", code="context_length_exceeded")
    seed = req.seed if req.seed is not None else (random.getrandbits(31) if req.temperature > 0 else None)
    params = SamplingParams(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, seed=seed,
                            stop=req.stop_strings, logprobs=req.logprobs, top_logprobs=req.top_logprobs or 0,
                            forced_ids=_required_opening(tok, state.template, req))
    # The `stop-string-kept` fault: the engine stops on the string but the reply is not cut before it.
    kept = state.engine.faults.enabled("stop-string-kept")
    output = OutputOptions(stop=() if kept else req.stop_strings, parse_tools=mode != "none" and bool(req.tools),
                           tool_names=frozenset(t["function"]["name"] for t in tools), forced_prefix=forced,
                           logprobs=req.logprobs, top_logprobs=req.top_logprobs or 0,
                           max_calls=None if req.parallel_tool_calls else 1)
    corruptor = None
    if state.engine.faults.enabled("tool-json-corrupt"):
        corruptor = ToolJsonCorruptor(request_key(ids, req.seed), state.env.tool_corrupt_rate)
    return Prepared(prompt.text, ids, params, output, corruptor)


def _required_opening(tok, template: ChatTemplate, req: ChatCompletionRequest) -> tuple[int, ...]:
    """tool_choice="required": the reply opens a tool-call block, by constrained decoding of the
    block's opening as the template writes it ("\n\n" and the tag for DeepSeek's V4 format, the tag
    alone for the canary model's), as SGLang and vLLM constrain it with a grammar. The tokens are
    generated, so they are reported, counted and logprobbed like any other; a model that would have
    opened the block anyway (the canary model) produces exactly the tokens it would have produced.
    "Required" holds per turn, not per response: once the current turn (everything after the last
    user message) holds an assistant tool call, the model may answer the results. That is how the
    canary model was trained ("required: every turn calls"), and forcing another call there would
    loop a client that keeps tool_choice for the whole conversation. Every other request is forced,
    whatever its last message (a system prompt alone, an assistant prefix, a tool result of an
    earlier turn)."""
    if req.tool_choice_mode != "required" or _turn_has_called(req.messages):
        return ()
    return tuple(tok.encode(call_opening(template, dsml.BLOCK_OPEN)))


def _turn_has_called(messages: list[Message]) -> bool:
    for message in reversed(messages):
        if message.role == "user":
            return False
        if message.role == "assistant" and message.tool_calls:
            return True
    return False


# ---- responses ----------------------------------------------------------------------------------
def _reason(state: ServerState, rid: str, builder: ChoiceBuilder, event: TokenOut) -> str | None:
    """The token's finish reason, or "stop" where the reply ended at its last allowed call
    (parallel_tool_calls=false, ChoiceBuilder): the engine stops generating it, counted as a "stop"
    (a complete reply), not as an abort (a client that gave up)."""
    if event.finish_reason is None and builder.ended:
        state.bridge.abort(rid, reason="stop")
        return "stop"
    return event.finish_reason


def _finish(state: ServerState, builder: ChoiceBuilder, reason: str) -> tuple[Delta, str]:
    """The builder's last delta and finish_reason; what its parser returned as content is counted."""
    last, finish = builder.finish(reason)
    for name in builder.rejected:
        state.metrics.dsml_rejected.labels(name).inc()
    return last, finish


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def stream_encoder(state: ServerState, rid: str, request: Request) -> ChunkEncoder:
    """A stream's chunk envelope. A PD server writes its request's chunks under the room's id and the
    router's `created`, which the other side of the pair writes too (runtime/disagg/protocol.py: the
    prefill server writes a relayed first token's chunks)."""
    room = request.headers.get(ROOM_HEADER) if state.pd is not None else None
    now = int(time.time())
    if room:
        return ChunkEncoder(completion_id(room), created_of(request.headers, now), state.model_name,
                            state.loaded.config.fingerprint)
    return ChunkEncoder(rid, now, state.model_name, state.loaded.config.fingerprint)


async def _stream(state: ServerState, rid: str, sink: asyncio.Queue, builder: ChoiceBuilder, encoder: ChunkEncoder,
                  prompt_tokens: int, include_usage: bool, trace: Trace = NO_TRACE) -> AsyncIterator[str]:
    completion = 0
    done = False
    try:
        opening = encoder.opening()
        # The prompt is computing: the client sees its stream open now. A PD decode server holds the
        # opening chunk for its first token (its headers are out already): an error before that token
        # is then the stream's first event, which the router may answer by offering the request to
        # another prefill server within the same stream (runtime/router.py).
        if sink.empty() and state.pd is None:
            yield opening
            opening = ""
        while not done:
            # Every event that has arrived (a step's token, or several steps' when this loop fell
            # behind) goes out in one write: a write costs the same for one chunk as for many.
            events = [await sink.get()]
            while not sink.empty():
                events.append(sink.get_nowait())
            out: list[str] = []
            for event in events:
                if isinstance(event, Rejected):  # the engine died under us: say so inside the stream
                    out.append(ApiError(500, event.message, type="server_error").event())
                    done = True
                    break
                if isinstance(event, Failed):  # PD decode, its room open: the error, inside the stream
                    out.append(event.error.event())
                    done = True
                    break
                # A PD first token the prefill server relayed (runtime/disagg/protocol.py): the router
                # wrote the opening and its chunk already; this stream says so in their place. Only the
                # first token can be: any later one is written out (and shows, if it is a duplicate).
                relayed = bool(opening) and isinstance(event, TokenOut) and event.relayed
                if opening:  # held until now: it goes out with the first token, in one write
                    out.append(RELAYED_EVENT if relayed else opening)
                    opening = ""
                reason = "abort" if isinstance(event, Aborted) else None
                if isinstance(event, TokenOut):
                    completion += 1
                    delta = builder.push(event.token, event.logprob, event.top, event.is_stop_token)
                    if not relayed:
                        out.append(encoder.token_chunk(delta))
                    reason = _reason(state, rid, builder, event)
                if reason is not None:
                    last, finish = _finish(state, builder, reason)
                    done = True
                    out.append(encoder.delta_chunk(last, delta_body(last), finish))
                    break
            if done and include_usage:
                body = {"id": encoder.id, "object": "chat.completion.chunk", "created": encoder.created,
                        "model": state.model_name,
                        "choices": [], "usage": _usage(prompt_tokens, completion)}
                out.append(sse_event(body))
            if done:
                out.append("data: [DONE]\n\n")
            if out:
                if completion and trace is not NO_TRACE:
                    trace.mark("first_token_out")  # the first write that carries a token
                yield "".join(out)
    finally:
        if not done:  # the client went away (or the server is stopping): free the request's pages
            state.bridge.abort(rid)


async def _unary(state: ServerState, request: Request, rid: str, sink: asyncio.Queue, builder: ChoiceBuilder,
                 prompt_tokens: int) -> JSONResponse:
    deltas: list[Delta] = []
    completion = 0
    finish = None
    # A watcher, not a timeout on each wait: tokens arrive faster than any poll interval, so a wait
    # that timed out only when idle never saw a client that left mid-generation.
    watcher = asyncio.ensure_future(_signal_disconnect(request, sink))
    try:
        while finish is None:
            event = await sink.get()
            if event is CLIENT_GONE:
                state.bridge.abort(rid)
                return JSONResponse({}, status_code=499)
            if isinstance(event, Rejected):
                raise ApiError(500, event.message, type="server_error")
            if isinstance(event, Failed):
                raise event.error
            reason = "abort" if isinstance(event, Aborted) else None
            if isinstance(event, TokenOut):
                completion += 1
                deltas.append(builder.push(event.token, event.logprob, event.top, event.is_stop_token))
                reason = _reason(state, rid, builder, event)
            if reason is not None:
                last, finish = _finish(state, builder, reason)
                deltas.append(last)
    except asyncio.CancelledError:
        state.bridge.abort(rid)
        raise
    finally:
        watcher.cancel()
    folded = fold(deltas)
    state.metrics.requests.labels(request.url.path, "200").inc()
    return JSONResponse({
        "id": rid, "object": "chat.completion", "created": int(time.time()), "model": state.model_name,
        "system_fingerprint": state.loaded.config.fingerprint,
        "choices": [{"index": 0, "message": folded["message"],
                     "logprobs": {"content": folded["logprobs"]} if builder.options.logprobs else None,
                     "finish_reason": finish}],
        "usage": _usage(prompt_tokens, completion)})


async def _signal_disconnect(request: Request, sink: asyncio.Queue) -> None:
    """The handler learns of its client's disconnect through its own queue."""
    await until_disconnected(request)
    sink.put_nowait(CLIENT_GONE)


__all__ = ["ServerState", "create_app"]
