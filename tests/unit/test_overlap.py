"""Overlap loop vs normal loop: the same workload gives the same tokens and logprobs.

Each workload is driven identically in both loops (arrivals by iteration, aborts triggered by how
many tokens the caller has seen), and each test asserts that what it claims to exercise happened:
aborts inside the overlap window, stop-string finishes with a discarded speculative row,
preemptions under a tiny pool (the driver is canary/faults/engine_gates.drive). "No extra decode" is checked
row by row, from each step's StepResult.plan: a request gets exactly
one row per delivered token, plus at most the one row already in flight when it stopped or was
aborted (none when it finished by length).
"""

from __future__ import annotations

import random

import pytest

from canary.faults.engine_gates import Arrival, drive
from runtime.config import EngineConfig
from runtime.engine.engine import Engine
from runtime.engine.request import SamplingParams
from runtime.env import Env
from runtime.faults import FaultSet

pytestmark = pytest.mark.unit


def make_workload(seed: int, num: int, *, aborts: bool, stops: dict[int, tuple[str, ...]] | None = None,
                  max_tokens: int = 16, max_prompt: int = 40) -> list[Arrival]:
    rng = random.Random(seed)
    items = []
    for i in range(num):
        prompt = [rng.randrange(256) for _ in range(rng.randint(1, max_prompt))]
        params = SamplingParams(max_tokens=rng.randint(1, max_tokens), ignore_eos=True, logprobs=True,
                                top_logprobs=5, temperature=rng.choice([0.0, 0.8]), seed=1000 + i,
                                stop=(stops or {}).get(i, ()))
        abort_after = abort_at = None
        if aborts and i % 3 == 0:
            abort_after = rng.choice([0, 1, 2, rng.randint(1, params.max_tokens)])
        elif aborts and i % 3 == 1 and rng.random() < 0.5:
            abort_at = rng.randint(0, 30)
        items.append(Arrival(rng.randint(0, 12), prompt, params, abort_after, abort_at))
    return items


def drive_like_the_server(engine: Engine, items: list[Arrival]) -> tuple[list, dict[str, int]]:
    """Run the workload like the server does (stream each step's outputs, drop finished requests
    from the table); returns the requests in workload order and the rows scheduled per request."""
    driven = drive(engine, items, drop_finished=True)
    assert not engine.scheduler.requests
    for req in driven.requests:
        assert driven.streamed.get(req.rid, []) == req.output_ids, f"{req.rid}: streamed tokens differ from its output"
    return driven.requests, driven.rows


def run(tiny, items, *, overlap: bool, faults=(), **cfg):
    engine = Engine(tiny, EngineConfig(**cfg), faults=FaultSet(faults), env=Env(), overlap=overlap)
    reqs, rows = drive_like_the_server(engine, items)
    assert engine.pages_in_use == 0
    if overlap:
        assert engine.runner.future.live == 0, "future-token slots leaked"
    return engine, reqs, rows


# A preempted request is recomputed by one prefill, and the CPU attention/indexer kernels are not
# bit-identical between a T-row prefill and a 1-row decode (shape-dependent einsum blocking). The
# loops preempt at different moments (overlap plans without the in-flight step's results), so a
# request recomputed in either loop is held to exact tokens and logprobs within this tolerance.
RECOMPUTED_LOGPROB_ATOL = 1e-5


def mismatches(items, normal, overlap) -> list[int]:
    bad = []
    for i, (it, a, b) in enumerate(zip(items, normal, overlap)):
        if a.num_preemptions or b.num_preemptions:
            n = min(len(a.output_ids), len(b.output_ids))
            close = all(abs(x - y) <= RECOMPUTED_LOGPROB_ATOL for x, y in zip(a.output_logprobs, b.output_logprobs))
            same_end = it.abort_at is not None or \
                (a.finish_reason, len(a.output_ids)) == (b.finish_reason, len(b.output_ids))
            if a.output_ids[:n] != b.output_ids[:n] or not close or not same_end:
                bad.append(i)
            continue
        if it.abort_at is not None and (a.finish_reason == "abort" or b.finish_reason == "abort"):
            # Aborted at an iteration: the loops deliver tokens at different iterations, so the
            # shorter output must be a prefix of the longer one.
            n = min(len(a.output_ids), len(b.output_ids))
            same = a.output_ids[:n] == b.output_ids[:n] and a.output_logprobs[:n] == b.output_logprobs[:n]
        else:
            same = (a.output_ids, a.output_logprobs, a.output_top_logprobs, a.finish_reason, a.matched_stop) == \
                   (b.output_ids, b.output_logprobs, b.output_top_logprobs, b.finish_reason, b.matched_stop)
        if not same:
            bad.append(i)
    return bad


def assert_no_extra_decode(reqs, rows, discarded: int, overlap: bool) -> None:
    extra = 0
    for req in reqs:
        delivered, scheduled = len(req.output_ids), rows.get(req.rid, 0)
        allowed = 1 if overlap and req.finish_reason in ("stop", "abort") else 0
        assert delivered <= scheduled <= delivered + allowed, \
            f"{req.rid} ({req.finish_reason}): {scheduled} rows for {delivered} delivered tokens"
        extra += scheduled - delivered
    assert extra == discarded


def compare_loops(tiny, items, **cfg):
    normal_engine, normal, normal_rows = run(tiny, items, overlap=False, **cfg)
    overlap_engine, overlap, overlap_rows = run(tiny, items, overlap=True, **cfg)
    assert mismatches(items, normal, overlap) == []
    assert_no_extra_decode(normal, normal_rows, normal_engine.scheduler.discarded_rows, overlap=False)
    assert_no_extra_decode(overlap, overlap_rows, overlap_engine.scheduler.discarded_rows, overlap=True)
    return normal_engine, overlap_engine, normal, overlap


def test_overlap_matches_normal_with_random_arrivals_and_aborts(tiny):
    items = make_workload(11, 30, aborts=True)
    normal_engine, overlap_engine, normal, overlap = compare_loops(tiny, items)
    aborted = [r for r in overlap if r.finish_reason == "abort"]
    assert len(aborted) >= 8, "the workload must really abort requests"
    assert any(r.output_ids for r in aborted) and any(not r.output_ids for r in aborted)
    assert overlap_engine.scheduler.aborts_in_flight >= 3, "aborts must land inside the overlap window"
    assert overlap_engine.scheduler.discarded_rows >= 3


def test_overlap_matches_normal_with_stop_strings(tiny):
    items = make_workload(12, 24, aborts=False, max_tokens=24)
    _, plain, _ = run(tiny, items, overlap=False)
    stops = {}
    for i, req in enumerate(plain):  # a stop string the unstopped output contains after its first token
        ascii_chars = [chr(t) for t in req.output_ids[1:] if 32 <= t < 127]
        if ascii_chars:
            stops[i] = (ascii_chars[-1], "never-matches")
    items = make_workload(12, 24, aborts=False, max_tokens=24, stops=stops)
    _, overlap_engine, normal, overlap = compare_loops(tiny, items)
    stopped = [r for r in normal if isinstance(r.matched_stop, str)]
    assert len(stopped) >= 5, "stop strings must really end requests"
    assert overlap_engine.scheduler.discarded_rows >= 5, "each stop inside the window discards one row"


def test_overlap_matches_normal_under_forced_preemption(tiny):
    items = make_workload(13, 16, aborts=True, max_tokens=20, max_prompt=12)
    normal_engine, overlap_engine, normal, overlap = compare_loops(tiny, items, num_pages=8, page_size=4)
    assert normal_engine.scheduler.num_preemptions >= 3, "the pool must be small enough to force preemption"
    assert overlap_engine.scheduler.num_preemptions >= 3, "the pool must be small enough to force preemption"
    assert sum(1 for a, b in zip(normal, overlap) if not a.num_preemptions and not b.num_preemptions) >= 4, \
        "some requests must stay on the exact (never recomputed) comparison"


def test_stale_future_token_is_caught_by_the_comparison(tiny):
    """Negative control: the overlap loop feeding the previous step's token must not go unnoticed."""
    items = make_workload(11, 30, aborts=True)
    _, normal, _ = run(tiny, items, overlap=False)
    _, stale, _ = run(tiny, items, overlap=True, faults=["overlap-stale-token"])
    assert len(mismatches(items, normal, stale)) >= 5
