"""The session driver: N concurrent multi-turn tool-call sessions against one target.

asyncio + the async openai client; a semaphore bounds concurrency (the load is ours, not xdist's).
Each request is streaming or not (seeded), optionally aborted mid-stream; tools run locally. Every
response is checked by the oracles as it arrives, and nothing is ever retried: the first wrong
answer is the finding.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import importlib
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from canary.oracles.golden import Transcript
from canary.oracles.stop_strings import check_stop_string
from canary.oracles.turn import (
    Failure,
    StreamProtocol,
    ToolCall,
    Turn,
    check_call_ids,
    check_control_text,
    check_finish_and_usage,
    check_gibberish,
    check_grounded_answer,
    check_grounded_arguments,
    check_nonce,
    check_required_calls,
    check_stream_equivalence,
    check_stream_protocol,
    check_tool_calls,
)
from canary.scenarios import Scenario, execute_tool, make_scenario
from canary.targets import Target
from canary.workload import SessionMix, choose_stop, multibyte_messages, plan_session, sampled_request

TOP_LOGPROBS = 5
MAX_HOPS = 3  # tool round trips within one user turn before the driver gives up on the turn
# Failures after which the turn's tool calls cannot be run locally, so even keep_going ends the session.
UNRUNNABLE_CALLS = frozenset({"json-parse", "known-function", "json-schema"})


@dataclass(frozen=True)
class DriverOptions:
    sessions: int = 80
    concurrency: int | None = None  # default: all sessions at once
    turns: int | None = None  # user turns per session (default: the scenario's own count)
    stream_ratio: float = 0.5
    abort_ratio: float = 0.0
    max_tokens: int = 160
    seed: int = 0
    request_timeout_s: float = 300.0
    logprobs: bool = True
    generic_prompts: bool = False  # real LLMs: plain-words instructions instead of the canary prompt
    # Driver processes, each with its own event loop and a share of the sessions. One asyncio loop
    # running the openai client tops out near 1,500 output tok/s (its request transform and response
    # models are most of it: py-spy on the H200 gate), so a fast server needs more than one; on a
    # 2-core machine the server needs the other core, so the default stays 1.
    processes: int = 1
    # The workload mix (canary/workload.py), fractions of sessions; the gate's defaults are in
    # canary/pytest_plugin.py, these are off so that a DriverOptions() is plain greedy turns.
    sampled_ratio: float = 0.0  # one seeded temperature/top-p probe
    stop_ratio: float = 0.0  # one stop-string probe
    multibyte_ratio: float = 0.0  # one multi-byte probe
    # A failed turn does not end its session (a calibrated run, canary/calibration.py): a model that
    # fails a task oracle in its first turn is still driven through its later turns, where a
    # load-dependent corruption may show. Every failure is still recorded; a session whose tool
    # calls cannot be run (unparseable, unknown or schema-invalid) still ends there.
    keep_going: bool = False

    def __post_init__(self) -> None:
        if self.processes < 1:
            raise ValueError(f"processes must be >= 1, got {self.processes}")


@dataclass
class RequestRecord:
    session: int
    hop: int  # request number within the session
    streamed: bool
    aborted: bool
    started: float
    first_token: float | None
    finished: float
    completion_tokens: int
    chunk_times: list[float]
    turn: Turn
    transcript: Transcript | None
    # The request's keyword arguments (stream flags aside) with a copy of `messages` taken when it
    # was sent (the list grows over the session): the load-vs-solo oracle replays exactly this.
    request: dict[str, Any] | None = None
    protocol: StreamProtocol | None = None  # streamed only: what the raw SSE carried
    prompt_tokens: int = 0  # from usage (0 if the server sent none): how much prefill the turn cost


# How a session ended: every session ends exactly one way, and all but "completed" say why.
COMPLETED, FAILED, ABORTED = "completed", "failed", "aborted"


@dataclass
class RunResult:
    options: DriverOptions
    target: str
    started: float
    wall_s: float
    requests: list[RequestRecord] = field(default_factory=list)
    failures: list[tuple[float, Failure]] = field(default_factory=list)
    sessions_completed: int = 0
    sessions_aborted: int = 0
    # (session, COMPLETED | FAILED | ABORTED, reason): the gate checks every session has one and that
    # each failed session's failure reached `failures` (driver_pool.run_sharded concatenates them).
    session_ends: list[tuple[int, str, str]] = field(default_factory=list)
    oracle_checks: dict[str, int] = field(default_factory=dict)  # oracle -> responses it checked (summed by shards)
    # (session, started, finished) of each non-streamed reference request that replays a streamed one:
    # not a record (golden keys and metrics count each turn once), but server time on the session's
    # critical path, which without them reads as the harness's time between requests.
    replays: list[tuple[int, float, float]] = field(default_factory=list)
    # Sharded runs: seconds from spawning the driver processes to the first session's start (their
    # interpreters and imports): the harness's, so outside `wall_s`, and reported beside it.
    startup_s: float = 0.0

    @property
    def transcripts(self) -> list[Transcript]:
        return [r.transcript for r in self.requests if r.transcript is not None and not r.aborted]


# Idle keep-alive connections are dropped after this long, well before a server closes them (uvicorn's
# default is 5 s, the same as httpx's default expiry): reusing a connection the server is closing at that
# instant fails with a transport error that says nothing about the server under test.
KEEPALIVE_EXPIRY_S = 2.0


def _http_client():
    from openai import DefaultAsyncHttpxClient
    from openai._constants import DEFAULT_CONNECTION_LIMITS as limits

    limits = type(limits)(max_connections=limits.max_connections,
                          max_keepalive_connections=limits.max_keepalive_connections,
                          keepalive_expiry=KEEPALIVE_EXPIRY_S)
    httpx = _openai_httpx()
    transport = _sse_probe_transport(httpx)(httpx.AsyncHTTPTransport(limits=limits))
    return DefaultAsyncHttpxClient(limits=limits, transport=transport)


SSE_PROBE = "canary_sse_done"


def _openai_httpx():
    """The httpx the openai client is built on (openai 3 ships its own fork, httpx2): its client
    asserts that transports and streams are its own classes."""
    from openai import DefaultAsyncHttpxClient

    return importlib.import_module(DefaultAsyncHttpxClient.__mro__[1].__module__.split(".")[0])


@functools.lru_cache(maxsize=2)
def _sse_probe_transport(httpx):
    """An httpx transport around the real one that attaches a StreamProtocol probe to every
    event-stream response (`response.extensions[SSE_PROBE]`), so the driver learns after the openai
    stream ends whether the raw bytes carried `data: [DONE]`, with no second request. The openai
    client swallows the terminator, and a stream that simply stops looks the same to it."""

    class ProbeStream(httpx.AsyncByteStream):
        """The bytes pass through unchanged; each complete `data:` line is noted."""

        def __init__(self, inner, probe: StreamProtocol) -> None:
            self._inner, self._probe, self._tail = inner, probe, b""

        async def __aiter__(self):
            async for chunk in self._inner:
                lines = (self._tail + chunk).split(b"\n")
                self._tail = lines.pop()  # an incomplete last line waits for the next chunk
                for line in lines:
                    self._line(line.strip())
                yield chunk
            self._line(self._tail.strip())

        def _line(self, line: bytes) -> None:
            if not line.startswith(b"data:"):
                return
            if self._probe.done:
                self._probe.events_after_done += 1
            elif line[5:].strip() == b"[DONE]":
                self._probe.done = True

        async def aclose(self) -> None:
            await self._inner.aclose()

    class ProbeTransport(httpx.AsyncBaseTransport):
        def __init__(self, inner) -> None:
            self._inner = inner

        async def handle_async_request(self, request):
            response = await self._inner.handle_async_request(request)
            if response.headers.get("content-type", "").startswith("text/event-stream"):
                probe = StreamProtocol()
                response.stream = ProbeStream(response.stream, probe)
                response.extensions = {**response.extensions, SSE_PROBE: probe}
            return response

        async def aclose(self) -> None:
            await self._inner.aclose()

    return ProbeTransport


class SessionDriver:
    def __init__(self, target: Target, options: DriverOptions,
                 on_request_done: Callable[[RequestRecord], None] | None = None,
                 shard: tuple[int, int] = (0, 1)) -> None:
        """shard = (k, n): drive the sessions whose index is k mod n (every session's nonce is still
        known, so the bleed oracle sees all of them)."""
        self.target = target
        self.options = options
        self.on_request_done = on_request_done
        all_scenarios = [make_scenario(i, options.turns, options.generic_prompts) for i in range(options.sessions)]
        self._nonces = [s.nonce for s in all_scenarios]
        self.scenarios = all_scenarios[shard[0]::shard[1]]
        self.shard = shard
        self._t0 = 0.0
        self._result = RunResult(options, target.name, 0.0, 0.0)  # replaced when the run starts

    def run(self) -> RunResult:
        """This driver's sessions in this process (canary.driver_pool.run_sessions spreads them)."""
        return asyncio.run(self._run())

    async def _run(self) -> RunResult:
        limit = self.options.concurrency or self.options.sessions
        limit = max(1, -(-limit // self.shard[1]))  # this shard's part of the concurrency bound
        client = self.target.async_client(timeout=self.options.request_timeout_s, http_client=_http_client())
        semaphore = asyncio.Semaphore(limit)
        self._t0 = time.perf_counter()
        self._result = RunResult(self.options, self.target.name, time.time(), 0.0)

        async def bounded(scenario: Scenario) -> None:
            async with semaphore:
                await self._session(client, scenario)

        try:
            await asyncio.gather(*(bounded(s) for s in self.scenarios))
        finally:
            await client.close()
        self._result.wall_s = time.perf_counter() - self._t0
        return self._result

    # ---- one session ---------------------------------------------------------------------------
    async def _session(self, client, scenario: Scenario) -> None:
        """One session; an HTTP error or a dropped connection ends it as a named failure (a server
        that answers 500 to a valid canary request is broken) instead of aborting the whole run."""
        import openai

        try:
            status, reason = await self._conversation(client, scenario)
        except (openai.APIStatusError, openai.APIConnectionError) as exc:
            code = getattr(exc, "status_code", None)
            oracle = "http-status" if code is not None else "transport"
            now = time.perf_counter() - self._t0
            cause = f" caused by {exc.__cause__!r}" if exc.__cause__ is not None else ""
            failure = Failure(oracle, scenario.index, -1, f"{type(exc).__name__} {code or ''}".strip() + cause,
                              str(exc)[:300])
            self._result.failures.append((now, failure))
            status, reason = FAILED, failure.describe()
        except Exception as exc:  # noqa: BLE001 - e.g. a stream the client cannot parse: one session's finding
            # Any other exception ends this session, not the run, and is a failure with its cause:
            # a response the harness cannot even read is as wrong as one an oracle rejects.
            failure = Failure("session-error", scenario.index, -1, f"session ended by {type(exc).__name__}",
                              str(exc)[:300])
            self._result.failures.append((time.perf_counter() - self._t0, failure))
            status, reason = FAILED, failure.describe()
        self._result.session_ends.append((scenario.index, status, reason))

    async def _conversation(self, client, scenario: Scenario) -> tuple[str, str]:
        """Returns how the session ended (COMPLETED, FAILED or ABORTED) and why; every failure it
        ends on is in `self._result.failures` before it returns."""
        rng = random.Random(f"{self.options.seed}:{scenario.seed}")
        mix = plan_session(self.options, scenario)
        messages: list[dict[str, Any]] = [{"role": "system", "content": scenario.system}]
        hop = 0
        aborts: list[str] = []
        first_failure: Failure | None = None
        for turn_index, user in enumerate(scenario.user_turns):
            messages.append({"role": "user", "content": user})
            made: list[ToolCall] = []  # the tool calls of this user turn, over all its requests
            for _ in range(MAX_HOPS):
                streamed = rng.random() < self.options.stream_ratio
                abort_after = rng.randint(1, 8) if streamed and rng.random() < self.options.abort_ratio else None
                record = await self._request(client, scenario, messages, hop, turn_index, streamed, abort_after)
                hop += 1
                if record.aborted:
                    # The client hung up mid-stream: the server must free the request and go on serving.
                    # The same request goes again, whole and not streamed, and the session goes on (its
                    # later turns are the check that the abort harmed nothing); it ends counted as
                    # aborted, with where, never as completed.
                    # It keeps the aborted request's number, so the session's requests are numbered (and
                    # golden transcripts keyed) the same whatever --abort-ratio.
                    aborts.append(f"client abort mid-stream at request {hop - 1} (turn {turn_index})")
                    streamed = False
                    record = await self._request(client, scenario, messages, hop - 1, turn_index, False, None)
                failures = self._check(scenario, record, messages)
                go_on = self.options.keep_going  # checks below also run after a failure (canary/calibration.py)
                if streamed and (go_on or not failures):
                    # Same request, not streamed: the reconstruction must be identical, and the
                    # reference is a response like any other (every oracle checks it too).
                    reference = await self._request(client, scenario, messages, hop, turn_index, False, None,
                                                    replay=True)
                    failures += self._check(scenario, reference, messages)
                    failures += self._record("stream-equivalence", check_stream_equivalence(record.turn,
                                                                                            reference.turn))
                if (go_on or not failures) and not record.turn.tool_calls and scenario.required_calls:
                    failures += self._record("required-calls", check_required_calls(
                        record.turn, made, list(scenario.required_calls[turn_index]),
                        exact=not self.options.generic_prompts))
                if (go_on or not failures) and not record.turn.tool_calls:
                    failures += await self._probes(client, scenario, messages, record, mix, turn_index)
                first_failure = first_failure or (failures[0] if failures else None)
                if failures and (not go_on or any(f.oracle in UNRUNNABLE_CALLS for f in failures)):
                    # A corrupted conversation cannot be continued meaningfully.
                    return FAILED, failures[0].describe()
                made += record.turn.tool_calls
                if not record.turn.tool_calls:
                    messages.append({"role": "assistant", "content": record.turn.content})
                    break
                messages.append({"role": "assistant", "content": record.turn.content or None, "tool_calls": [
                    {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                    for c in record.turn.tool_calls]})
                for call in record.turn.tool_calls:
                    result = execute_tool(call.name, json.loads(call.arguments))
                    messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
            else:
                # MAX_HOPS requests and still calling tools: the turn never got its answer, and the
                # session cannot go on as if it had.
                failure = Failure("session-incomplete", scenario.index, turn_index,
                                  f"no final answer after {MAX_HOPS} requests of tool calls", str(made)[:300])
                self._record("session-incomplete", [failure])
                return FAILED, failure.describe()
        if first_failure is not None:  # keep_going: the session went on to its end after this
            return FAILED, first_failure.describe() + "; the session went on to its end (keep_going)"
        if aborts:
            self._result.sessions_aborted += 1
            return ABORTED, "; ".join(aborts) + "; the session went on to its end"
        self._result.sessions_completed += 1
        return COMPLETED, ""

    async def _probes(self, client, scenario: Scenario, messages: list[dict], answer: RequestRecord, mix: SessionMix,
                      turn_index: int) -> list[Failure]:
        """The turn's final request again, as this session's mix asks (canary/workload.py): with a
        stop string cut from its answer, sampled with a seed, with multi-byte text. The replies never
        enter the conversation; each is numbered as its answer with its kind after it (`req-5.stop`),
        so the main requests' numbers, and golden keys, do not depend on the mix's ratios."""
        failures: list[Failure] = []
        hop = answer.hop
        if turn_index == mix.stop_turn:
            stop = choose_stop(answer.turn.content, mix, turn_index)
            if stop is not None:
                probe = await self._request(client, scenario, messages, hop, turn_index, scenario.index % 2 == 0,
                                            None, extra={"stop": [stop]}, probe="stop")
                failures += self._check(scenario, probe, messages, probe="stop")
                failures += self._record("stop-string", check_stop_string(probe.turn, answer.turn.content, stop))
        if turn_index == mix.sampled_turn and not failures:
            probe = await self._request(client, scenario, messages, hop, turn_index, scenario.index % 2 == 1,
                                        None, extra=sampled_request({}, mix, turn_index), probe="sampled")
            failures += self._check(scenario, probe, messages, probe="protocol")
        if turn_index == mix.multibyte_turn and not failures:
            decorated = multibyte_messages(messages, mix, turn_index)
            probe = await self._request(client, scenario, decorated, hop, turn_index, scenario.index % 2 == 0,
                                        None, probe="multibyte")
            failures += self._check(scenario, probe, decorated, probe="protocol")
        return failures

    def _record(self, oracle: str, failures: list[Failure]) -> list[Failure]:
        """Count one run of `oracle` and put its failures on the run's record: no oracle's findings
        may stop short of the verdict."""
        self._result.oracle_checks[oracle] = self._result.oracle_checks.get(oracle, 0) + 1
        now = time.perf_counter() - self._t0
        self._result.failures += [(now, f) for f in failures]
        return failures

    def _check(self, scenario: Scenario, record: RequestRecord, messages: list[dict],
               probe: str | None = None) -> list[Failure]:
        """`probe` (canary/workload.py): "stop" for a stop-string reply, which is not the whole greedy
        answer, so the oracles that hold a reply to that answer (grounding, the nonce echo) do not
        apply; "protocol" for a sampled or multi-byte reply, which is the model's own output off its
        training distribution (measured: a sampled enum value 'SD', a DSML block the model left
        half-open): only the protocol oracles hold it, the golden store and the replays its tokens."""
        turn = record.turn
        record_ = self._record
        if probe == "protocol":
            return (record_("nonce", check_nonce(turn, scenario.nonce, lambda: self._nonces, must_echo=False))
                    + record_("finish-and-usage", check_finish_and_usage(turn))
                    + record_("tool-call-id", check_call_ids(turn))
                    + (record_("stream-protocol", check_stream_protocol(turn, record.protocol, include_usage=True))
                       if record.protocol is not None else []))
        failures = record_("tool-calls", check_tool_calls(turn, scenario.schemas))
        if not self.options.generic_prompts and not probe:
            # The canary model copies values verbatim; a real LLM may legitimately normalise them.
            conversation = "\n".join(str(m.get("content") or "") for m in messages if m["role"] != "assistant")
            failures += record_("grounded-arguments", check_grounded_arguments(turn, conversation))
            if not turn.tool_calls:
                failures += record_("grounded-answer", check_grounded_answer(turn, conversation))
        failures += record_("nonce", check_nonce(turn, scenario.nonce, lambda: self._nonces,
                                                 must_echo=not probe and not turn.tool_calls
                                                 and turn.finish_reason == "stop"))
        failures += record_("gibberish", check_gibberish(turn))
        failures += record_("finish-and-usage", check_finish_and_usage(turn))
        failures += record_("tool-call-id", check_call_ids(turn))
        failures += record_("control-text", check_control_text(turn))
        if record.protocol is not None:
            failures += record_("stream-protocol", check_stream_protocol(turn, record.protocol, include_usage=True))
        return failures

    # ---- one request ---------------------------------------------------------------------------
    async def _request(self, client, scenario: Scenario, messages: list[dict], hop: int, turn_index: int,
                       streamed: bool, abort_after: int | None, replay: bool = False,
                       extra: dict[str, Any] | None = None, probe: str | None = None) -> RequestRecord:
        """`extra`: request fields over the greedy defaults (a probe's stop string or sampling);
        `probe`: the probe's kind, which its transcript key carries after the hop."""
        kwargs: dict[str, Any] = dict(model=self.target.model, messages=messages, tools=scenario.tools,
                                      tool_choice=scenario.tool_choice, temperature=0.0, seed=scenario.seed,
                                      max_tokens=self.options.max_tokens)
        kwargs.update(extra or {})
        if self.options.logprobs:
            kwargs.update(logprobs=True, top_logprobs=TOP_LOGPROBS)
        body = {**kwargs, "messages": copy.deepcopy(messages)}
        started = time.perf_counter()
        if streamed:
            record = await self._streamed(client, kwargs, scenario, hop, turn_index, started, abort_after)
        else:
            record = await self._unary(client, kwargs, scenario, hop, turn_index, started)
        record.request = body
        if probe is not None and record.transcript is not None:
            record.transcript.scenario += f".{probe}"
        if replay:
            self._result.replays.append((record.session, record.started, record.finished))
        else:
            self._result.requests.append(record)
            if self.on_request_done:
                self.on_request_done(record)
        return record

    async def _unary(self, client, kwargs, scenario, hop, turn_index, started) -> RequestRecord:
        resp = await client.chat.completions.create(**kwargs)
        finished = time.perf_counter()
        choice = resp.choices[0]
        calls = [ToolCall(c.id, c.function.name, c.function.arguments) for c in (choice.message.tool_calls or [])]
        content = choice.logprobs.content if choice.logprobs else None
        tokens, tops = _logprob_tokens(content)
        usage = resp.usage.model_dump() if resp.usage else None
        turn = Turn(scenario.index, turn_index, False, choice.message.content or "", calls, choice.finish_reason,
                    _usage(usage), kwargs["max_tokens"], tokens)
        completion = usage["completion_tokens"] if usage else len(tokens)
        return RequestRecord(scenario.index, hop, False, False, started, None, finished, completion, [], turn,
                             _transcript(scenario, hop, tokens, tops, _own_logprobs(content)),
                             prompt_tokens=usage.get("prompt_tokens") or 0 if usage else 0)

    async def _streamed(self, client, kwargs, scenario, hop, turn_index, started, abort_after) -> RequestRecord:
        stream = await client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
        # The transport's probe sees the raw lines ([DONE]); the chunks below fill in the rest.
        protocol = stream.response.extensions.get(SSE_PROBE) or StreamProtocol()
        content, finish, usage = "", None, None
        calls: dict[int, dict[str, str]] = {}
        tokens: list = []
        tops: list = []
        own: list[float] = []
        chunk_times: list[float] = []
        first_token = None
        aborted = False
        chunks = 0
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.usage:
                usage = chunk.usage.model_dump()
                protocol.usage_chunks += 1
            for choice in chunk.choices:
                delta = choice.delta
                # A token counts when it arrives, also while the server holds its text back (a tool
                # call goes out whole once its invoke closed): its logprob entry marks its arrival.
                if delta.content or delta.tool_calls or (choice.logprobs and choice.logprobs.content):
                    first_token = first_token or now
                    chunk_times.append(now)
                if delta.content:
                    content += delta.content
                for tc in delta.tool_calls or []:
                    if tc.index not in calls:
                        protocol.tool_call_indexes.append(tc.index)
                    entry = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                    if tc.id:
                        entry["id"] = entry["id"] or tc.id
                    if tc.function and tc.function.name:
                        entry["name"] += tc.function.name
                    if tc.function and tc.function.arguments:
                        entry["arguments"] += tc.function.arguments
                if choice.logprobs and choice.logprobs.content:
                    t, p = _logprob_tokens(choice.logprobs.content)
                    tokens += t
                    tops += p
                    own += _own_logprobs(choice.logprobs.content)
                if choice.finish_reason:
                    finish = choice.finish_reason
            chunks += 1
            if abort_after is not None and chunks >= abort_after and finish is None:
                aborted = True
                break
        await stream.close()
        finished = time.perf_counter()
        tool_calls = [ToolCall(c["id"], c["name"], c["arguments"]) for _, c in sorted(calls.items())]
        turn = Turn(scenario.index, turn_index, True, content, tool_calls, finish, _usage(usage),
                    kwargs["max_tokens"], tokens, aborted=aborted)
        completion = usage["completion_tokens"] if usage else len(tokens)
        return RequestRecord(scenario.index, hop, True, aborted, started, first_token, finished, completion,
                             chunk_times, turn, None if aborted else _transcript(scenario, hop, tokens, tops, own),
                             protocol=protocol, prompt_tokens=usage.get("prompt_tokens") or 0 if usage else 0)


def _usage(usage: dict | None) -> dict[str, int] | None:
    if usage is None:
        return None
    return {k: usage[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens") if usage.get(k) is not None}


def _logprob_tokens(content) -> tuple[list, list]:
    if not content:
        return [], []
    tokens = [item.token for item in content]
    tops = [[(alt.token, alt.logprob) for alt in (item.top_logprobs or [])] for item in content]
    return tokens, tops


def _own_logprobs(content) -> list[float]:
    """Per token, the logprob of the token itself (the golden store compares these within a tolerance)."""
    return [float(item.logprob) for item in content or ()]


def _transcript(scenario: Scenario, hop: int, tokens: list, tops: list, logprobs: list[float]) -> Transcript | None:
    if not tokens:
        return None
    return Transcript(f"session-{scenario.seed}-req-{hop}", tokens, tops, logprobs=logprobs)
