"""Scheduler page accounting at page boundaries: a request holds exactly the pages its KV needs.

A prompt whose length is an exact multiple of the page size is the boundary where a ceiling done
wrong (`n // page_size + 1`, or reserving room for the next token early) takes one page too many.
The engine-level tests do not see that: their prompts rarely land on a multiple, and an extra page
is returned on finish like any other, so nothing leaks. Here the scheduler is driven with fake
tokens (no model), and every extend must hold ceil(tokens with KV / page_size) pages, no more.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from runtime.config import EngineConfig
from runtime.engine.plan import StepPlan
from runtime.engine.request import Request, SamplingParams
from runtime.engine.sampler import SampleOutput
from runtime.engine.scheduler import Scheduler
from runtime.graph.runner import STEP_BUCKETS, step_buckets
from runtime.kvcache.page_pool import PagePool

pytestmark = pytest.mark.unit

TOKEN = 7  # never the (absent) eos: requests finish by length only
NO_EOS = SimpleNamespace(eos_token_id=-1)


def exact_pages(tokens: int, page_size: int) -> int:
    return (tokens + page_size - 1) // page_size


def check_pages(plan: StepPlan, scheduler: Scheduler, page_size: int) -> None:
    for ext in plan.extends:
        kv_tokens = ext.start + ext.num_new  # positions 0 .. end-1 have KV once this step ran
        assert ext.num_pages == exact_pages(kv_tokens, page_size), (
            f"step {plan.step}: {ext.rid} holds {ext.num_pages} pages for {kv_tokens} tokens "
            f"(page size {page_size})")
    held = sum(len(req.pages) for req in scheduler.running)
    assert scheduler.pool.pages_in_use == held, "the pool counts pages no running request holds"


def drive(scheduler: Scheduler, page_size: int, overlap: bool) -> list[StepPlan]:
    """Run to completion. overlap: plan step N+1 before postprocessing step N, as the overlap loop
    does (the scheduler then counts N's token as in flight)."""
    plans, last = [], None
    while scheduler.has_work or last is not None:
        plan = scheduler.schedule() if scheduler.has_work else None
        if plan is not None:
            check_pages(plan, scheduler, page_size)
            plans.append(plan)
        done = last if overlap else plan
        if done is not None:
            scheduler.postprocess(done, {ext.rid: SampleOutput(TOKEN, 0.0, []) for ext in done.extends})
        last = plan if overlap else None
    return plans


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("pages", [1, 3])
def test_a_prompt_of_whole_pages_takes_exactly_those_pages(page_size, pages, overlap):
    pool = PagePool(64, page_size)
    scheduler = Scheduler(EngineConfig(page_size=page_size, num_pages=64), pool, NO_EOS)
    # Enough output tokens to cross two more page boundaries while decoding.
    max_tokens = 2 * page_size + 1
    scheduler.add(Request("whole", [1] * (pages * page_size), SamplingParams(max_tokens=max_tokens)))
    plans = drive(scheduler, page_size, overlap)
    prefill = plans[0].prefill[0]
    assert (prefill.num_new, prefill.num_pages) == (pages * page_size, pages), "the prefill took an extra page"
    assert sum(len(p.decode) for p in plans) == max_tokens - 1  # the last token needs no KV of its own
    assert scheduler.requests["whole"].finish_reason == "length"
    assert pool.pages_in_use == 0


def test_a_pool_of_exactly_the_prompt_pages_admits_every_whole_page_prompt():
    """Four prompts of two whole pages each fill an 8-page pool in one prefill step; one extra page
    per request would leave some of them waiting."""
    page_size = 4
    pool = PagePool(8, page_size)
    scheduler = Scheduler(EngineConfig(page_size=page_size, num_pages=8), pool, NO_EOS)
    for i in range(4):
        scheduler.add(Request(f"r{i}", [1] * (2 * page_size), SamplingParams(max_tokens=1)))
    plan = scheduler.schedule()
    assert [ext.num_pages for ext in plan.prefill] == [2, 2, 2, 2]
    assert pool.free_pages == 0
    scheduler.postprocess(plan, {ext.rid: SampleOutput(TOKEN, 0.0, []) for ext in plan.extends})
    assert not scheduler.has_work and pool.pages_in_use == 0


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_a_kept_request_keeps_its_pages_after_finishing_and_an_aborted_one_does_not(overlap):
    """PD prefill (`Request.keep_pages`): a finished request's pages stay allocated to it, listed in
    `pages`, until the caller frees them; an aborted one's go back to the pool as usual."""
    pool = PagePool(16, 4)
    scheduler = Scheduler(EngineConfig(page_size=4, num_pages=16), pool, NO_EOS)
    scheduler.add(Request("kept", [1] * 9, SamplingParams(max_tokens=1), keep_pages=True))
    scheduler.add(Request("plain", [1] * 9, SamplingParams(max_tokens=1)))
    drive(scheduler, 4, overlap)
    kept = scheduler.requests["kept"]
    assert kept.finish_reason == "length" and len(kept.pages) == 3
    pool.check_owned("kept", kept.pages)
    assert pool.pages_in_use == 3 and scheduler.requests["plain"].pages == []
    pool.free("kept", kept.pages)
    scheduler.add(Request("gone", [1] * 9, SamplingParams(max_tokens=1), keep_pages=True))
    scheduler.schedule()
    scheduler.abort("gone")
    scheduler.schedule()
    assert scheduler.requests["gone"].finish_reason == "abort" and pool.pages_in_use == 0


@pytest.mark.parametrize("max_running", [64, 128])
def test_the_busiest_step_fits_the_static_runners_largest_graph_bucket(max_running):
    """A full prefill budget arriving while every other request decodes is the largest step the
    scheduler plans; the static runner's buckets (`step_buckets`) must hold it, or that step (the
    busiest kind) leaves the graphs for eager passes (and, on the H200, Triton compiles mid-run).
    Control: STEP_BUCKETS alone, which stopped at the prefill budget, do not hold it."""
    cfg = EngineConfig(page_size=16, num_pages=4096, max_running_requests=max_running, max_model_len=8192)
    scheduler = Scheduler(cfg, PagePool(cfg.num_pages, cfg.page_size), NO_EOS)
    for i in range(max_running - 1):
        scheduler.add(Request(f"d{i}", [1] * 4, SamplingParams(max_tokens=64)))
    first = scheduler.schedule()
    scheduler.postprocess(first, {ext.rid: SampleOutput(TOKEN, 0.0, []) for ext in first.extends})
    scheduler.add(Request("long", [1] * (cfg.max_prefill_tokens - 6), SamplingParams(max_tokens=6)))
    busiest = scheduler.schedule()
    rows = sum(ext.num_new for ext in busiest.extends)
    assert len(busiest.decode) == max_running - 1 and len(busiest.prefill) == 1
    assert rows <= max(step_buckets(cfg.max_prefill_tokens, cfg.max_running_requests))
    assert rows > max(STEP_BUCKETS), "the control: the old buckets would have sent this step to eager passes"


def test_step_buckets_keep_the_fine_ones_and_stay_sorted():
    buckets = step_buckets(16384, 64)
    assert buckets[:len(STEP_BUCKETS)] == STEP_BUCKETS and list(buckets) == sorted(set(buckets))
    assert buckets[-1] == 16384 + 64 and buckets[-2] == 16384  # every 1,024 rows past 4,096, then the exact top
    assert step_buckets(1024, 64) == STEP_BUCKETS  # the budget fits already: nothing added
