"""One perf trial: a short, fixed workload whose figures are stable from one trial to the next.

- decode tok/s at fixed concurrency levels: C identical streamed requests sent at once, so the
  server decodes a batch of exactly C rows until they all stop together (same prompt, greedy: same
  length); the figure is C / mean TPOT, the batch's decode rate, free of prefill and of ramp-up.
  The burst is sent `rounds` times back to back (5 by default) and the figure is the median
  burst's: one burst at C=8 lasts ~0.6 s on the 2-core CPU, and the host dips 25-35% in about 8% of
  bursts (120 alternating bursts of two clean servers, 2026-12-04), which moves one burst's figure by
  its whole size; a median of 5 ignores up to two dips, where a single burst carries each one into
  the verdict's noise (docs/results.md, twentieth session).
- TTFT at a fixed arrival rate: requests of distinct prompts sent on a fixed clock (not as a burst,
  whose p50 depends on where each request lands in the queue), one output token each; the figure
  is the median TTFT. An A/B pair's two series run on one clock, their requests alternating. The
  prompts are distinct across trials, verdicts and gate runs too (a nonce per trial): a server with
  a prefix cache (the embedded runtime on CPU, SGLang's radix cache) answers a prompt it has seen
  from its cache, so a long-lived baseline server that had seen a trial's prompts in an earlier
  verdict read 10x the TTFT of a fresh candidate (2-core CPU, 2026-12-04).

Servers this project did not write: completion tokens are the usage chunk's where the stream ends
with one (`stream_options.include_usage`; the embedded runtime's figures and the stored baselines are
counted so), else counted from the streamed deltas (one per logprob entry where they come, else one
per delta with text or a tool call: a server that merges tokens into one delta, as llama-cpp-python
does while it holds back a partial UTF-8 character or stop string, is counted low, alike on both sides
of an A/B pair); each trial says which (`TrialFigures.tokens_counted`). llama-cpp-python 0.3.36 sends no
usage chunk. `logprobs=False` leaves them out of the trials' requests: a server that computes them
slowly (llama-cpp-python sorts the whole vocabulary per token for top logprobs) would otherwise be
measured doing that. A stream without any token or without a finish_reason is an error, not a fast trial.

A burst of whole multi-turn sessions (the gate's correctness workload) mixes all of this with the
harness's own speed and the sessions' random lengths: its p50 moved 33-69% between runs of one build.
Raw HTTP (httpx, SSE parsed here): the harness must cost the 2-core machine as little as it can.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field

from canary.targets import Target


@dataclass(frozen=True)
class TrialWorkload:
    concurrency: tuple[int, ...] = (1, 8)  # decode tok/s measured at each level
    max_tokens: int = 48
    ttft_rate: float = 4.0  # requests per second for the TTFT figure (0 = no TTFT figure)
    ttft_requests: int = 8
    timeout_s: float = 120.0
    rounds: int = 5  # decode bursts per level; the figure is the median burst's
    logprobs: bool = True  # ask for logprobs in the trials' requests (off: a server where they are costly)

    def __post_init__(self) -> None:
        if self.rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {self.rounds}")
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError(f"concurrency levels must be >= 1, got {self.concurrency}")
        if self.max_tokens < 2:
            raise ValueError(f"max_tokens must be >= 2 (a decode rate needs two tokens), got {self.max_tokens}")

    def metrics(self) -> list[str]:
        names = [f"decode_tok_s@{c}" for c in self.concurrency]
        return names + ([f"ttft_s@{self.ttft_rate:g}rps"] if self.ttft_rate > 0 and self.ttft_requests else [])

    def describe(self) -> dict:
        described = {"concurrency": list(self.concurrency), "max_tokens": self.max_tokens,
                     "ttft_rate": self.ttft_rate, "ttft_requests": self.ttft_requests, "rounds": self.rounds}
        # `logprobs` only where off: the baselines recorded before it existed asked for them.
        return described | ({"logprobs": False} if not self.logprobs else {})

    @classmethod
    def from_dict(cls, described: dict) -> TrialWorkload:
        """`describe()`'s inverse; keys left out take their defaults (`--perf-workload '{"logprobs": false}'`).
        A stored record's workload is read by `read_recorded` instead: there a missing key has its own meaning."""
        unknown = set(described) - set(WORKLOAD_KEYS)
        if unknown:
            raise ValueError(f"unknown trial workload keys {sorted(unknown)}; known: {', '.join(WORKLOAD_KEYS)}")
        for key, value in described.items():
            default = getattr(cls(), key)
            if key == "concurrency":
                ok = isinstance(value, list | tuple) and all(map(_is_int, value))
            elif isinstance(default, bool):
                ok = isinstance(value, bool)
            else:
                ok = _is_int(value) or (isinstance(default, float) and isinstance(value, float))
            if not ok:
                raise ValueError(f"trial workload {key} = {value!r}: expected {type(default).__name__}")
        values = dict(described)
        if "concurrency" in values:
            values["concurrency"] = tuple(values["concurrency"])
        return cls(**values)


WORKLOAD_KEYS = ("concurrency", "max_tokens", "ttft_rate", "ttft_requests", "rounds", "logprobs")
# What a stored record's missing key meant when it was written: until the twentieth session (2026-12-04)
# `describe()` left `rounds` out where it was 1 (then the default); `logprobs` is left out where on.
RECORDED_BEFORE_KEYS = {"rounds": 1, "logprobs": True}


def read_recorded(described: dict) -> TrialWorkload:
    """A stored record's workload (a baseline's, an A/B or trials log's): `describe()`'s output of the
    version that wrote it, whose missing keys mean `RECORDED_BEFORE_KEYS`, not today's defaults."""
    return TrialWorkload.from_dict(RECORDED_BEFORE_KEYS | described)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class TrialFigures:
    """One trial's figures, metric name -> value (`TrialWorkload.metrics()` names them), and how its
    requests' completion tokens were counted: `tokens_counted` = {"usage": requests counted from the
    usage chunk, "deltas": requests counted from the streamed deltas} (only the ways that occurred;
    empty where a measure does not say, e.g. a synthetic one in tests)."""

    figures: dict[str, float]
    tokens_counted: dict[str, int] = field(default_factory=dict)

    def record(self) -> dict:
        """The trial's entry for the stored or A/B record (plain JSON): its figures, and how it
        counted tokens where it says."""
        counted = {"tokens_counted": dict(self.tokens_counted)} if self.tokens_counted else {}
        return {"figures": dict(self.figures), **counted}


def higher_is_better(metric: str) -> bool:
    return metric.startswith("decode_tok_s")


@dataclass
class _Timing:
    started: float
    first_token: float | None = None
    finished: float = 0.0
    tokens: int = 0
    counted: str = ""  # "usage" | "deltas": where `tokens` came from


def _messages(target: Target, index: int, salt: str = "") -> tuple[list[dict], dict]:
    """A canary scenario's first request (the canary model gets its trained prompt, any other model
    plain words); `salt` makes a prompt distinct where a server caches prefixes."""
    from canary.options import serves_canary_model
    from canary.scenarios import make_scenario

    scenario = make_scenario(index, 1, generic=not (target.embedded or serves_canary_model(target.model)))
    system = scenario.system + (f" ({salt})" if salt else "")
    messages = [{"role": "system", "content": system}, {"role": "user", "content": scenario.user_turns[0]}]
    return messages, {"tools": scenario.tools, "tool_choice": scenario.tool_choice}


async def _stream(client, target: Target, messages: list[dict], extra: dict, max_tokens: int,
                  logprobs: bool = True) -> _Timing:
    body = {"model": target.model, "messages": messages, **extra, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}, **({"logprobs": True} if logprobs else {})}
    timing = _Timing(time.perf_counter())
    usage: int | None = None
    streamed = 0  # tokens counted from the deltas
    finish_reason = None
    async with client.stream("POST", target.url_for("v1", "chat", "completions"), json=body,
                             headers=target.headers) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"perf trial request failed: HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", ()):
                delta = choice.get("delta") or {}
                entries = (choice.get("logprobs") or {}).get("content") or []
                # A token's logprob entry marks its arrival, also while its text is held back (a tool call).
                if delta.get("content") or delta.get("tool_calls") or entries:
                    timing.first_token = timing.first_token or time.perf_counter()
                    streamed += max(len(entries), 1)
                finish_reason = choice.get("finish_reason") or finish_reason
    timing.finished = time.perf_counter()
    timing.tokens, timing.counted = (usage, "usage") if usage is not None else (streamed, "deltas")
    if timing.first_token is None or not timing.tokens:
        raise RuntimeError(f"perf trial request returned no tokens (streamed {streamed}, usage {usage})")
    if finish_reason is None:
        raise RuntimeError(f"perf trial stream ended without a finish_reason after {streamed} tokens: cut short")
    return timing


async def _decode_rate(client, target: Target, concurrency: int, max_tokens: int, logprobs: bool = True,
                       counted: Counter | None = None) -> float:
    messages, extra = _messages(target, 0)
    timings = await asyncio.gather(*(_stream(client, target, messages, extra, max_tokens, logprobs)
                                     for _ in range(concurrency)))
    if counted is not None:
        counted.update(t.counted for t in timings)
    tpots = [(t.finished - t.first_token) / (t.tokens - 1) for t in timings if t.first_token and t.tokens > 1]
    if not tpots:
        raise RuntimeError("perf trial: every request stopped after one token; raise max_tokens")
    return concurrency / statistics.fmean(tpots)


# How a TTFT request waits for its send time (a unit test puts a virtual clock here, so its checks of the
# schedule do not depend on how busy the machine running it is).
_pace = asyncio.sleep


async def _ttft_on_one_clock(client, targets: list[Target], rate: float, count: int, trial: str,
                            logprobs: bool = True, counted: list[Counter] | None = None) -> list[float]:
    """Each target's median TTFT of `count` requests sent `rate` a second, every target's series on
    one clock: target j's request i leaves at (i + j / n) / rate, so the targets' requests alternate
    and a drift of the machine (a load spike on a shared runner, a clock change on the GPU) falls on
    every target alike. Whole series one after the other read a load spike on one side only: on the
    2-core CPU the pair's TTFT log-ratio had an sd of 0.2-0.27 that way (2026-12-04). `trial` names
    the trial's prompts: request i carries the same prompt on every target, new to each server."""
    n = len(targets)

    async def one(j: int, i: int) -> float:
        await _pace((i + j / n) / rate)
        messages, extra = _messages(targets[j], 1 + i, salt=f"{trial}r{i}")
        timing = await _stream(client, targets[j], messages, extra, 1, logprobs)
        assert timing.first_token is not None
        if counted is not None:
            counted[j][timing.counted] += 1
        return timing.first_token - timing.started

    ttfts = await asyncio.gather(*(one(j, i) for j in range(n) for i in range(count)))
    return [statistics.median(ttfts[j * count:(j + 1) * count]) for j in range(n)]


async def _trials(targets: list[Target], workload: TrialWorkload, trial: int, transport=None) -> list[TrialFigures]:
    """One trial per target, their decode bursts taken in turns (round r visits the targets in
    order, round r + 1 in reverse), so a drift of the machine slower than a burst or two falls on
    every target alike; then the TTFT series of every target on one clock (`_ttft_on_one_clock`)."""
    import httpx

    limits = httpx.Limits(max_connections=max((*workload.concurrency, len(targets) * workload.ttft_requests)) + 4)
    prompts = f"t{trial}-{uuid.uuid4().hex[:12]}"  # the TTFT prompts' name: new to every server (docstring)
    counted: list[Counter] = [Counter() for _ in targets]
    figures: list[dict[str, float]] = [{} for _ in targets]
    async with httpx.AsyncClient(timeout=workload.timeout_s, limits=limits, transport=transport) as client:
        for c in workload.concurrency:
            bursts: list[list[float]] = [[] for _ in targets]
            for r in range(workload.rounds):
                order = range(len(targets)) if r % 2 == 0 else reversed(range(len(targets)))
                for i in order:
                    bursts[i].append(await _decode_rate(client, targets[i], c, workload.max_tokens,
                                                        workload.logprobs, counted[i]))
            for i in range(len(targets)):
                figures[i][f"decode_tok_s@{c}"] = statistics.median(bursts[i])
        if workload.ttft_rate > 0 and workload.ttft_requests:
            medians = await _ttft_on_one_clock(client, targets, workload.ttft_rate, workload.ttft_requests,
                                               prompts, workload.logprobs, counted)
            for i, median in enumerate(medians):
                figures[i][f"ttft_s@{workload.ttft_rate:g}rps"] = median
    return [TrialFigures(f, dict(sorted(n.items()))) for f, n in zip(figures, counted)]


def measure_trial(target: Target, workload: TrialWorkload, trial: int = 0) -> TrialFigures:
    """One trial's figures, with how it counted tokens."""
    return asyncio.run(_trials([target], workload, trial))[0]


def measure_pair(first: Target, second: Target, workload: TrialWorkload,
                 trial: int = 0) -> tuple[TrialFigures, TrialFigures]:
    """An A/B pair's two trials, bursts interleaved (`_trials`), on the same prompts. On the H200 the
    canary's decode@1 figure (~40 ms bursts, host-bound) wandered 700-1,370 tok/s between trials of
    one server taken a second apart, together on both servers: whole trials one after the other left
    the same build's A/B interval at +-14% with the median of 10 bursts (2026-12-02)."""
    first_figures, second_figures = asyncio.run(_trials([first, second], workload, trial))
    return first_figures, second_figures
