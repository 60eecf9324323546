"""PagePool accounting: never a leak, never a double allocation, misuse raises."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from runtime.faults import FaultSet
from runtime.kvcache.page_pool import DoubleFreeError, OutOfPagesError, PagePool, UseAfterFreeError

pytestmark = pytest.mark.unit
NUM_PAGES = 24


class PoolMachine(RuleBasedStateMachine):
    """Random arrivals, growth, finishes and aborts against a model of who owns what."""

    faults = FaultSet()

    def __init__(self) -> None:
        super().__init__()
        self.pool = PagePool(NUM_PAGES, 4, self.faults)
        self.held: dict[str, list[int]] = {}
        self.next_id = 0

    @rule(n=st.integers(0, 6))
    def arrive(self, n):
        rid = f"r{self.next_id}"
        self.next_id += 1
        if self.pool.can_allocate(n):
            self.held[rid] = self.pool.allocate(rid, n)
        else:
            with pytest.raises(OutOfPagesError):
                self.pool.allocate(rid, n)

    @precondition(lambda self: self.held)
    @rule(data=st.data(), n=st.integers(1, 3))
    def grow(self, data, n):
        rid = data.draw(st.sampled_from(sorted(self.held)))
        if self.pool.can_allocate(n):
            self.held[rid] += self.pool.allocate(rid, n)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def finish_or_abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.held)))
        self.pool.free(rid, self.held.pop(rid))

    @invariant()
    def no_page_owned_twice_and_no_leak(self):
        owned = [p for pages in self.held.values() for p in pages]
        assert len(owned) == len(set(owned)), "a page is held by two live requests"
        assert self.pool.pages_in_use == len(owned), "accounting drifted from what requests hold"
        assert self.pool.free_pages + self.pool.pages_in_use == NUM_PAGES

    def teardown(self):
        for rid, pages in list(self.held.items()):
            self.pool.free(rid, pages)
        assert self.pool.pages_in_use == 0, "pages did not return to idle"


TestPagePoolStateful = PoolMachine.TestCase
TestPagePoolStateful.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


def test_stateful_invariant_catches_the_kv_slot_reuse_fault():
    """Negative control: with the allocator bug on, the invariant above must fire."""

    class FaultyMachine(PoolMachine):
        faults = FaultSet(["kv-slot-reuse"])

    faulty = FaultyMachine.TestCase
    faulty.settings = settings(max_examples=60, stateful_step_count=40, deadline=None, database=None)
    with pytest.raises(AssertionError, match="held by two live requests"):
        faulty().runTest()


def test_double_free_raises():
    pool = PagePool(4, 2)
    pages = pool.allocate("a", 2)
    pool.free("a", pages)
    with pytest.raises(DoubleFreeError):
        pool.free("a", pages)


def test_freeing_another_requests_page_raises():
    pool = PagePool(4, 2)
    pool.allocate("a", 1)
    b_pages = pool.allocate("b", 1)
    with pytest.raises(DoubleFreeError):
        pool.free("a", b_pages)


def test_use_after_free_raises():
    pool = PagePool(4, 2)
    pages = pool.allocate("a", 2)
    pool.check_owned("a", pages)
    pool.free("a", pages)
    with pytest.raises(UseAfterFreeError):
        pool.check_owned("a", pages)


def test_out_of_pages_is_reported_and_changes_nothing():
    pool = PagePool(3, 2)
    pool.allocate("a", 2)
    with pytest.raises(OutOfPagesError):
        pool.allocate("b", 2)
    assert pool.pages_in_use == 2 and pool.free_pages == 1
