"""Latency and throughput figures of one driver run (TTFT, TPOT, ITL percentiles, output tok/s)."""

from __future__ import annotations

from canary.driver import RunResult
from canary.perf.verdict import summarize


def run_metrics(result: RunResult) -> dict:
    done = [r for r in result.requests if not r.aborted]
    streamed = [r for r in done if r.streamed and r.first_token is not None]
    first = [(r, r.first_token) for r in streamed if r.first_token is not None]  # (narrowed for the type checker)
    ttft = [t - r.started for r, t in first]
    tpot = [(r.finished - t) / (r.completion_tokens - 1) for r, t in first if r.completion_tokens > 1]
    itl = [b - a for r in streamed for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    tokens = sum(r.completion_tokens for r in done)
    return {
        "requests": len(result.requests),
        "aborted_requests": sum(r.aborted for r in result.requests),
        "completion_tokens": tokens,
        # Every turn re-sends its whole conversation and the runtime has no prefix cache: the prompt
        # tokens are the prefill work the run cost, beside the tokens it produced.
        "prompt_tokens": sum(r.prompt_tokens for r in done),
        "wall_s": result.wall_s,
        "driver_startup_s": result.startup_s,
        "output_tok_s": tokens / result.wall_s if result.wall_s > 0 else 0.0,
        "ttft_s": summarize(ttft),
        "tpot_s": summarize(tpot),
        "itl_s": summarize(itl),
        "e2e_s": summarize([r.finished - r.started for r in done]),
        "critical_path": critical_path(result.requests, result.replays),
    }


def critical_path(records, replays=()) -> dict | None:
    """Where the run's wall time goes. A session's turns run one after the other, so the run lasts
    as long as its longest session: its time inside its requests (the server's latency: its recorded
    requests and the non-streamed reference request that replays each streamed one, `replays` as
    (session, started, finished)) and between them (the harness reading, checking and building the
    next turn). Also every session's gaps between consecutive requests of either kind, so the
    harness's share shows apart from the server's."""
    sessions: dict[int, list[tuple[float, float]]] = {}
    for r in records:
        sessions.setdefault(r.session, []).append((r.started, r.finished))
    for session, started, finished in replays:
        sessions.setdefault(session, []).append((started, finished))
    if not sessions:
        return None
    gaps: list[float] = []
    longest = None
    for spans in sessions.values():
        spans.sort()
        gaps += [b_start - a_end for (_, a_end), (b_start, _) in zip(spans, spans[1:])]
        span = spans[-1][1] - spans[0][0]
        if longest is None or span > longest[0]:
            longest = (span, spans)
    assert longest is not None
    span, spans = longest
    inside = sum(end - start for start, end in spans)
    return {"longest_session_s": span, "longest_session_requests": len(spans), "longest_inside_requests_s": inside,
            "longest_between_requests_s": span - inside, "between_requests_s": summarize(gaps)}
