"""Page tables kept across steps: a plan carries each request's new pages only (`Extend.first_page`,
`Extend.new_pages`), and each runner appends them to the request's row of `PageTables`.

The risk of a persistent table is a stale row: a request preempted, aborted or finished whose row
is not released, so a later table (its recompute, or another request reusing the row) still shows
pages that now belong to someone else. These tests rebuild every request's whole table from the
scheduler's `req.pages` and compare it with what the runner fed the model, in both loops, under
preemption and aborts, and check that a missed release or re-padding is caught.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from runtime.config import EngineConfig
from runtime.engine.engine import Engine
from runtime.engine.plan import Extend, StepPlan
from runtime.engine.request import Request, SamplingParams
from runtime.engine.sampler import SampleOutput
from runtime.engine.scheduler import Scheduler
from runtime.env import Env
from runtime.faults import FaultSet
from runtime.kvcache.page_pool import PagePool, UseAfterFreeError
from runtime.kvcache.page_table import PageTables, StalePageTableError

pytestmark = pytest.mark.unit

PAD = 99


def ext(rid: str, first: int, new: tuple[int, ...]) -> Extend:
    return Extend(rid, 0, 1, first, new)


def test_rows_grow_by_deltas_and_are_padded_again_on_release():
    tables = PageTables(max_pages=6, pad_page=PAD, rows=1, mirrored=True)
    row = tables.apply(ext("a", 0, (4, 5)))
    tables.apply(ext("a", 2, ()))  # a decode that needed no page
    tables.apply(ext("a", 2, (7,)))
    assert tables.pages("a").tolist() == [4, 5, 7]
    assert tables.block[row].tolist() == [4, 5, 7, PAD, PAD, PAD]
    tables.apply(ext("b", 0, (1,)))  # a second live request: the block grows
    assert tables.live == 2 and len(tables.block) == 2
    tables.release("a")
    tables.release("a")  # idempotent: a finish after an abort of the same request
    assert tables.block[row].tolist() == [PAD] * 6
    assert tables.apply(ext("c", 0, (2,))) == row  # the row is reused, padded past its new length
    assert tables.block[row].tolist() == [2] + [PAD] * 5
    # Every entry written since the start, once each: a's three pages (padded again), b's, c's.
    assert tables.take_changes().tolist() == [row * 6 + col for col in range(3)] + [6]
    assert tables.take_changes().tolist() == []
    tables.apply(ext("c", 1, (3, 8)))
    assert tables.take_changes().tolist() == [row * 6 + 1, row * 6 + 2]


def test_a_delta_that_does_not_continue_the_row_raises():
    tables = PageTables(max_pages=4, pad_page=PAD)
    tables.apply(ext("a", 0, (1, 2)))
    with pytest.raises(StalePageTableError, match="missed release"):
        tables.apply(ext("a", 0, (3,)))  # a recompute over a row that was never released
    with pytest.raises(StalePageTableError, match="appends pages at 1"):
        tables.apply(ext("a", 1, (3,)))
    with pytest.raises(StalePageTableError, match="holds none"):
        tables.apply(ext("b", 2, (3,)))  # a row this runner never saw (PD: the first step must send all)
    with pytest.raises(RuntimeError, match="exceed max_model_len"):
        tables.apply(ext("a", 2, (3, 4, 5)))


def test_check_table_sees_a_freed_page_of_an_earlier_step():
    pool = PagePool(8, 4)
    pages = pool.allocate("a", 3)
    pool.check_table("a", (), 3)
    pool.free("a", pages[1:2])  # one page of the table goes back to the pool behind the plan's back
    with pytest.raises(UseAfterFreeError, match="has 3 pages, it holds 2"):
        pool.check_table("a", (), 3)


NO_EOS = SimpleNamespace(eos_token_id=-1)


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_scheduler_deltas_rebuild_every_running_table(overlap):
    """Replaying the deltas of every plan gives each request exactly `req.pages`, through decode
    growth, preemption (recompute starts a fresh table) and aborts."""
    page_size = 2
    pool = PagePool(24, page_size)
    scheduler = Scheduler(EngineConfig(page_size=page_size, num_pages=24, max_model_len=64,
                                       max_prefill_tokens=64), pool, NO_EOS)
    rng = random.Random(0)
    for i in range(6):
        scheduler.add(Request(f"r{i}", [1] * rng.randint(1, 9), SamplingParams(max_tokens=rng.randint(4, 14))))
    replayed: dict[str, list[int]] = {}
    last = None
    while scheduler.has_work or last is not None:
        plan = scheduler.schedule() if scheduler.has_work else None
        if plan is not None:
            if plan.step == 5:
                scheduler.abort("r1")
            for rid in plan.aborted + plan.preempted:
                replayed.pop(rid, None)
            for e in plan.extends:
                if e.first_page == 0:
                    assert e.rid not in replayed, f"{e.rid}: a fresh table over a live one"
                    replayed[e.rid] = []
                assert len(replayed[e.rid]) == e.first_page
                replayed[e.rid] += e.new_pages
            for req in scheduler.running:
                if req.rid in replayed:
                    assert replayed[req.rid] == req.pages, f"step {plan.step}: {req.rid}'s table differs"
        done = last if overlap else plan
        if done is not None:
            scheduler.postprocess(done, {e.rid: SampleOutput(7, 0.0, []) for e in done.extends})
            for req in scheduler.finished:
                replayed.pop(req.rid, None)
            scheduler.finished.clear()
        last = plan if overlap else None
    assert scheduler.num_preemptions > 0, "the pool must be small enough to force preemption"
    assert scheduler.requests["r1"].finish_reason == "abort"
    assert pool.pages_in_use == 0


def expected_rows(plan: StepPlan, requests, max_pages: int, pad: int) -> np.ndarray:
    """[rows, max_pages] each row's whole page table, built from scratch as before the deltas."""
    rows = []
    for e in plan.extends:
        pages = requests[e.rid].pages
        rows += [pages + [pad] * (max_pages - len(pages))] * e.num_new
    return np.array(rows, dtype=np.int64)


def run_checked(tiny, overlap: bool, tables_bug=None, table_rows: int | None = None) -> Engine:
    """Static runner on the CPU, a small pool (preemption) and an abort; every step's page table (as
    gathered from the runner's device copy) is compared with one rebuilt from the scheduler's page
    lists. `table_rows`: start the runner's tables that small, so they grow while requests run."""
    cfg = EngineConfig(runner="static", num_pages=24, page_size=4, max_model_len=96, max_running_requests=4,
                       max_prefill_tokens=96)
    engine = Engine(tiny, cfg, FaultSet(), Env(), overlap=overlap)
    runner = engine.runner
    if table_rows is not None:
        runner.tables = PageTables(runner.max_pages, runner.scratch_page, rows=table_rows, mirrored=True)
        runner.device_tables = torch.tensor(runner.tables.block)
    if tables_bug is not None:
        tables_bug(runner.tables)
    build = runner.build_step

    def checked_build(plan, requests):
        rows = build(plan, requests)
        want = expected_rows(plan, requests, runner.max_pages, runner.scratch_page)
        assert np.array_equal(rows.inputs.page_table.cpu().numpy(), want), f"step {plan.step}: stale page table"
        return rows

    runner.build_step = checked_build
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 200) for _ in range(rng.randint(20, 40))] for _ in range(7)]
    params = [SamplingParams(max_tokens=rng.randint(8, 24), ignore_eos=True) for _ in prompts]
    rids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    steps = 0
    while engine.has_work:
        engine.step()
        steps += 1
        if steps == 6:
            engine.abort(rids[1])
    assert engine.scheduler.num_preemptions > 0, "the pool must be small enough to force preemption"
    assert engine.scheduler.requests[rids[1]].finish_reason == "abort"
    assert engine.pages_in_use == 0 and runner.tables.live == 0
    return engine


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_static_runner_tables_match_the_scheduler_through_preemption_and_abort(tiny, overlap):
    run_checked(tiny, overlap)


def test_static_runner_tables_grow_on_the_device_too(tiny):
    engine = run_checked(tiny, overlap=True, table_rows=1)
    assert len(engine.runner.device_tables) == len(engine.runner.tables.block) > 1


def test_a_device_copy_that_misses_changes_is_caught(tiny):
    """Negative control: the device copy must receive every changed entry (here: none reach it)."""
    def drop_changes(tables):
        take = tables.take_changes
        tables.take_changes = lambda: take()[:0]
    with pytest.raises(AssertionError, match="stale page table"):
        run_checked(tiny, overlap=True, tables_bug=drop_changes)


def test_a_missed_release_is_caught(tiny):
    """Negative control: rows never released (preemption, abort, finish) must not run silently."""
    def keep_rows(tables):
        tables.release = lambda rid: None
    with pytest.raises(StalePageTableError):
        run_checked(tiny, overlap=False, tables_bug=keep_rows)


def test_a_row_reused_without_padding_is_caught(tiny):
    """Negative control: a released row that keeps its old pages shows them to its next owner."""
    def forget_padding(tables):
        def release(rid):
            row = tables._row.pop(rid, None)
            if row is not None:
                tables.length.pop(rid)
                tables._free.append(row)
        tables.release = release
    with pytest.raises(AssertionError, match="stale page table"):
        run_checked(tiny, overlap=False, tables_bug=forget_padding)


def test_pd_first_step_sends_the_whole_table(tiny):
    """A request admitted with its pages already filled (PD decode) has never been in a plan here:
    its first decode extend must start a fresh table holding every page."""
    cfg = EngineConfig(runner="static", num_pages=32, page_size=4, max_model_len=96)
    engine = Engine(tiny, cfg, FaultSet(), Env())
    req = Request("pd", list(range(3, 13)), SamplingParams(max_tokens=3, ignore_eos=True))
    req.pages = engine.pool.allocate("pd", 3)
    req.output_ids = [5]
    assert engine.admit_prefilled(req) is None
    result = engine.step()
    (first,) = result.plan.decode
    assert (first.first_page, first.new_pages) == (0, tuple(req.pages))
    second = engine.step().plan.decode[0]
    assert (second.first_page, second.new_pages) == (3, ())


@pytest.mark.parametrize("runner", ["eager", "static"])
def test_a_preemption_between_steps_reaches_the_runner(tiny, runner):
    """A preemption outside `schedule` (the engine tests force one between steps) is listed in the next
    plan, so the runner drops the row before the recompute starts a fresh one."""
    engine = Engine(tiny, EngineConfig(runner=runner, num_pages=32, page_size=4, max_model_len=96), FaultSet(),
                    Env())
    req = engine.scheduler.requests[engine.add_request(list(range(3, 20)), SamplingParams(max_tokens=8,
                                                                                          ignore_eos=True))]
    plans = []
    while engine.has_work:
        plans.append(engine.step().plan)
        if len(req.output_ids) == 3 and not req.num_preemptions:
            engine.scheduler._preempt(req)
    recompute = next(p for p in plans if p.preempted)
    assert recompute.preempted == (req.rid,) and recompute.prefill[0].first_page == 0
    assert req.finish_reason == "length" and len(req.output_ids) == 8
    assert engine.runner.tables.live == 0 and engine.pages_in_use == 0
