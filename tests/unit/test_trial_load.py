"""The perf trial's requests against servers that do not behave like the embedded runtime (issue 17
items 4-5): no usage chunk (llama-cpp-python 0.3.36 sends none), logprobs left out where a server
computes them slowly, and streams that end without a token or a finish_reason. A fake server
(httpx.MockTransport) answers with SSE streams built here."""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import json
import math

import httpx
import pytest

from canary.perf import trial_load
from canary.perf.trial_load import TrialWorkload
from canary.perf.trials import ab_trials, record_trials, sequential_pair, workload_from
from canary.targets import Target

pytestmark = pytest.mark.unit

TARGET = Target("fake", "http://fake/v1", "m", False)
A, B = Target("a", "http://a/v1", "m", False), Target("b", "http://b/v1", "m", False)


def sse(chunks: list[dict], done: bool = True) -> bytes:
    return b"".join(f"data: {json.dumps(c)}\n\n".encode() for c in chunks) + (b"data: [DONE]\n\n" if done else b"")


def chunk(content: str | None = None, finish: str | None = None, logprobs: int = 0, role: bool = False) -> dict:
    delta = {"role": "assistant"} if role else ({"content": content} if content is not None else {})
    entries = [{"token": "x", "logprob": -0.1, "top_logprobs": []} for _ in range(logprobs)]
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish,
                         "logprobs": {"content": entries} if entries else None}]}


def reply(tokens: int, *, usage: int | None = None, finish: str | None = "length", logprobs: int = 0,
          done: bool = True) -> bytes:
    """A stream of `tokens` text deltas (each with `logprobs` entries), its finish chunk, and a usage
    chunk saying `usage` where given (as a server does on `stream_options.include_usage`)."""
    chunks = [chunk(role=True)] + [chunk(f"t{i} ", logprobs=logprobs) for i in range(tokens)]
    chunks.append(chunk(finish=finish) if finish else chunk(""))
    if usage is not None:
        chunks.append({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": usage,
                                                "total_tokens": 9 + usage}})
    return sse(chunks, done)


class FakeServer:
    """Answers every chat completion with `answer(body)` (SSE bytes) and keeps the request bodies."""

    def __init__(self, answer) -> None:
        self.answer, self.bodies, self.hosts = answer, [], []

    def transport(self) -> httpx.MockTransport:
        def handle(request: httpx.Request) -> httpx.Response:
            body = json.loads(request.content)
            self.bodies.append(body)
            self.hosts.append(request.url.host)
            return httpx.Response(200, content=self.answer(body), headers={"content-type": "text/event-stream"})

        return httpx.MockTransport(handle)


def stream(server: FakeServer, max_tokens: int = 8, logprobs: bool = True):
    async def go():
        async with httpx.AsyncClient(transport=server.transport()) as client:
            messages = [{"role": "user", "content": "hi"}]
            return await trial_load._stream(client, TARGET, messages, {}, max_tokens, logprobs)

    return asyncio.run(go())


def test_without_a_usage_chunk_tokens_are_counted_from_the_deltas():
    """llama-cpp-python's streams end with no usage chunk: the old trial raised on every request."""
    timing = stream(FakeServer(lambda body: reply(6)))
    assert (timing.tokens, timing.counted) == (6, "deltas")
    # A logprob entry is one token, also where a delta carries several (or its text is held back).
    timing = stream(FakeServer(lambda body: reply(3, logprobs=2)))
    assert (timing.tokens, timing.counted) == (6, "deltas")


def test_with_a_usage_chunk_its_count_is_kept():
    """The usage chunk stays the count where it comes: the embedded runtime's figures and the stored
    baselines were measured so (here usage says 7 for 5 deltas: a server merging two tokens in one)."""
    timing = stream(FakeServer(lambda body: reply(5, usage=7)))
    assert (timing.tokens, timing.counted) == (7, "usage")


@pytest.mark.parametrize("answer", [
    pytest.param(lambda body: reply(0, usage=0), id="no token, usage 0"),
    pytest.param(lambda body: reply(0), id="no token, no usage"),
    pytest.param(lambda body: reply(0, usage=5), id="usage 5 but no token streamed"),
    pytest.param(lambda body: reply(4, usage=0), id="tokens streamed but usage 0"),
])
def test_a_stream_without_tokens_is_an_error(answer):
    with pytest.raises(RuntimeError, match="no tokens"):
        stream(FakeServer(answer))


@pytest.mark.parametrize("usage", [None, 6])
def test_a_stream_without_a_finish_reason_is_an_error_not_a_fast_trial(usage):
    """A stream cut short (llama-cpp-python's `interrupt_requests`: `[DONE]` and no finish_reason)
    would otherwise count as a short, fast request."""
    with pytest.raises(RuntimeError, match="finish_reason"):
        stream(FakeServer(lambda body: reply(6, usage=usage, finish=None)))
    with pytest.raises(RuntimeError, match="finish_reason"):
        stream(FakeServer(lambda body: reply(6, usage=usage, finish=None, done=False)))


def test_logprobs_are_asked_for_by_default_and_left_out_on_request():
    server = FakeServer(lambda body: reply(4, usage=4))
    stream(server)
    stream(server, logprobs=False)
    assert server.bodies[0]["logprobs"] is True and "logprobs" not in server.bodies[1]
    assert all(b["stream_options"] == {"include_usage": True} for b in server.bodies)


def test_logprobs_off_changes_the_workload_description_only_when_off():
    """Stored baselines' fingerprints hold `describe()`: logprobs on must describe as before
    `logprobs` existed (no key for it)."""
    assert TrialWorkload().describe() == {"concurrency": [1, 8], "max_tokens": 48, "ttft_rate": 4.0,
                                          "ttft_requests": 8, "rounds": 5}
    off = TrialWorkload(logprobs=False)
    assert off.describe() == {**TrialWorkload().describe(), "logprobs": False}
    assert workload_from({"workload": off.describe()}) == off
    assert workload_from({"workload": TrialWorkload().describe()}) == TrialWorkload()
    assert TrialWorkload.from_dict({"concurrency": [1], "logprobs": False}) == TrialWorkload(
        concurrency=(1,), logprobs=False)
    with pytest.raises(ValueError, match="unknown trial workload keys"):
        TrialWorkload.from_dict({"logprob": False})


def test_a_trial_without_usage_or_logprobs_measures_and_says_how_it_counted():
    """The whole trial against a server like llama-cpp-python (no usage chunk; logprobs off): every
    request counted from its deltas, none asked for logprobs, and the record says so."""
    server = FakeServer(lambda body: reply(body["max_tokens"]))
    workload = TrialWorkload(concurrency=(1, 2), max_tokens=4, ttft_rate=50.0, ttft_requests=3, rounds=2,
                             logprobs=False)
    figures = asyncio.run(trial_load._trials([TARGET], workload, 0, transport=server.transport()))[0]
    assert set(figures.figures) == set(workload.metrics()) and all(v > 0 for v in figures.figures.values())
    assert figures.tokens_counted == {"deltas": 2 * (1 + 2) + 3}
    assert not any("logprobs" in b for b in server.bodies)
    assert figures.record() == {"figures": figures.figures, "tokens_counted": {"deltas": 9}}


def ttft_prompts(server: FakeServer) -> list[str]:
    """The system prompts of the TTFT requests (one output token each) the fake server saw."""
    return [b["messages"][0]["content"] for b in server.bodies if b["max_tokens"] == 1]


def test_ttft_prompts_are_new_to_the_server_in_every_trial():
    """A server with a prefix cache answers a prompt it has seen from its cache: a long-lived baseline
    server that had seen an earlier verdict's TTFT prompts read a tenth of a fresh candidate's TTFT. Two
    trials with the same index (two verdicts, two gate runs) send no prompt twice, and a pair's two
    sides get the same prompts (the prompts named by the trial index alone repeated: caught)."""
    server = FakeServer(lambda body: reply(body["max_tokens"]))
    workload = TrialWorkload(concurrency=(1,), max_tokens=4, ttft_rate=50.0, ttft_requests=3)
    for _ in range(2):
        asyncio.run(trial_load._trials([TARGET], workload, 0, transport=server.transport()))
    seen = ttft_prompts(server)
    assert len(seen) == 6 and len(set(seen)) == 6
    pair = FakeServer(lambda body: reply(body["max_tokens"]))
    asyncio.run(trial_load._trials([A, B], workload, 0, transport=pair.transport()))
    sent = {host: [p for p, h in zip(ttft_prompts(pair), ttft_hosts(pair)) if h == host] for host in "ab"}
    assert sent["a"] == sent["b"] and len(set(sent["a"])) == 3


def ttft_hosts(server: FakeServer) -> list[str]:
    return [h for b, h in zip(server.bodies, server.hosts) if b["max_tokens"] == 1]


def test_a_pairs_ttft_series_share_one_clock_so_a_drift_falls_on_both_sides(monkeypatch):
    """Each server still gets `ttft_rate` requests a second, the two servers' requests alternating. On
    a machine that slows as the trial goes on, the pair reads the two equal servers within the drift of
    half an interval; negative control: the series one after the other (the old trial) read the second
    server far slower. On a virtual clock: each request's send time is the one it waited for, so the
    schedule is checked exactly on a machine however busy (the wall clock failed this test under load)."""
    sent: list[tuple[str, float]] = []
    send_at: contextvars.ContextVar[float] = contextvars.ContextVar("send_at")
    offset = 0.0  # where on the virtual clock the series starts

    async def pace(delay: float) -> None:  # each request's own task: its context holds its send time
        send_at.set(offset + delay)

    async def drifting_stream(client, target, messages, extra, max_tokens, logprobs=True):
        now = send_at.get()
        sent.append((target.name, now))
        ttft = 0.01 * math.exp(4.0 * now)  # the machine slows ~4x a second
        return trial_load._Timing(now, first_token=now + ttft, finished=now + ttft, tokens=1, counted="usage")

    monkeypatch.setattr(trial_load, "_pace", pace)
    monkeypatch.setattr(trial_load, "_stream", drifting_stream)
    workload = TrialWorkload(concurrency=(1,), ttft_rate=20.0, ttft_requests=6)

    async def series(targets):
        return await trial_load._ttft_on_one_clock(None, targets, workload.ttft_rate, workload.ttft_requests, "t")

    a, b = asyncio.run(series([A, B]))
    in_time = sorted(sent, key=lambda s: s[1])
    assert [name for name, _ in in_time] == ["a", "b"] * 6
    for name in "ab":
        times = [t for n, t in in_time if n == name]
        assert all(later - earlier == pytest.approx(1 / workload.ttft_rate) for earlier, later in zip(times, times[1:]))
    assert b / a < 1.2
    # The old trial: B's whole series after A's, on the same drifting machine.
    a = asyncio.run(series([A]))[0]
    offset = workload.ttft_requests / workload.ttft_rate
    b = asyncio.run(series([B]))[0]
    assert b / a > 2


def test_the_trials_records_say_how_tokens_were_counted():
    def measure(target, workload, trial):
        counted = {"usage": 3} if target.name == "a" else {"deltas": 3}
        return trial_load.TrialFigures({"decode_tok_s@8": 100.0, "ttft_s@4rps": 0.5}, counted)

    workload = TrialWorkload(concurrency=(8,), ttft_rate=4.0, ttft_requests=4)
    a, b = Target("a", "http://a/v1", "m", False), Target("b", "http://b/v1", "m", False)
    outcome = ab_trials(b, a, workload, 0.1, min_pairs=2, max_pairs=2, run_pair=sequential_pair(measure))
    assert {(t["side"], json.dumps(t["tokens_counted"])) for t in outcome.trials} == {
        ("baseline", '{"usage": 3}'), ("candidate", '{"deltas": 3}')}
    recorded = record_trials(a, workload, trials=2, measure=measure)
    assert all(t["tokens_counted"] == {"usage": 3} for t in recorded["trials"])
    json.dumps(recorded)  # a plain dict: the baseline file holds it


def test_a_pairs_bursts_take_turns_so_a_drift_falls_on_both_sides(monkeypatch):
    """Two equal servers on a machine that slows 2% per burst: with the bursts in turns the pair
    reads them within the drift of one burst; negative control: whole trials one after the other
    (`sequential_pair`) read the second server ~10% slower. ab_trials' default run_pair is the one
    in turns."""
    visits: list[str] = []
    clock = itertools.count()

    async def fake_rate(client, target, concurrency, max_tokens, *_):
        visits.append(target.name)
        return 100.0 * 0.98 ** next(clock)

    monkeypatch.setattr(trial_load, "_decode_rate", fake_rate)
    workload = TrialWorkload(concurrency=(8,), ttft_rate=0.0, rounds=5)
    a, b = Target("a", "http://a/v1", "m", False), Target("b", "http://b/v1", "m", False)
    first, second = trial_load.measure_pair(a, b, workload)
    assert visits == ["a", "b", "b", "a", "a", "b", "b", "a", "a", "b"]
    assert second.figures["decode_tok_s@8"] / first.figures["decode_tok_s@8"] == pytest.approx(0.98)
    clock = itertools.count()
    first, second = sequential_pair(trial_load.measure_trial)(a, b, workload, 0)
    assert second.figures["decode_tok_s@8"] / first.figures["decode_tok_s@8"] == pytest.approx(0.98 ** 5)
    visits.clear()
    ab_trials(b, a, TrialWorkload(concurrency=(8,), ttft_rate=0.0, rounds=2), 0.1, min_pairs=2, max_pairs=2)
    # The warm-up pair (baseline a first), then pairs a b and b a: each pair's bursts in turns.
    assert visits == ["a", "b", "b", "a"] * 2 + ["b", "a", "a", "b"]
