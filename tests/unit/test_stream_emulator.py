"""Adversarial stream emulator: the model is order-independent when its joins are right, and the
`stream-race` fault (one dropped join) is exposed on a plain CPU, deterministically."""

from __future__ import annotations

import pytest
import torch

from runtime.kvcache.kv_cache import KVCache
from runtime.streams.emulator import AdversarialExecutor
from runtime.streams.tasks import MAIN, InOrderExecutor, Task
from tests.utils import ExtendCase

pytestmark = pytest.mark.unit


def test_late_mode_defers_side_tasks_until_joined():
    ran = []
    ex = AdversarialExecutor(mode="late")
    ex.fork("side")
    ex.submit(Task("idx", "side", (), ("sel",), fn=lambda: ran.append("idx")))
    ex.submit(Task("other", MAIN, (), (), fn=lambda: ran.append("other")))
    assert ran == ["other"], "a side task must not run before something waits on it"
    ex.join("side")
    assert ran == ["other", "idx"]
    ex.submit(Task("late", "side", (), (), fn=lambda: ran.append("late")))
    ex.synchronize()
    assert ran == ["other", "idx", "late"], "synchronize drains every side stream"


def test_side_task_waits_for_its_fork_and_other_side_streams():
    ran = []
    ex = AdversarialExecutor(mode="random", seed=3)
    ex.fork("a")
    ex.submit(Task("a1", "a", (), (), fn=lambda: ran.append("a1")))
    ex.wait("b", ex.record("a"))  # b's next task depends on a1
    ex.submit(Task("b1", "b", (), (), fn=lambda: ran.append("b1")))
    ex.join("b")
    assert ran.index("a1") < ran.index("b1"), "a cross-stream wait must be honoured"


def test_random_mode_explores_more_than_one_order():
    orders = set()
    for seed in range(20):
        ran = []
        ex = AdversarialExecutor(mode="random", seed=seed)
        ex.fork("side")
        ex.submit(Task("idx", "side", (), (), fn=lambda ran=ran: ran.append("idx")))
        ex.submit(Task("m1", MAIN, (), (), fn=lambda ran=ran: ran.append("m1")))
        ex.submit(Task("m2", MAIN, (), (), fn=lambda ran=ran: ran.append("m2")))
        ex.synchronize()
        orders.add(tuple(ran))
    assert len(orders) > 1, "random mode must not collapse to a single schedule"


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("mode", ["late", "random"])
def test_model_output_equals_in_order_under_adversarial_streams(tiny, seed, mode):
    case = ExtendCase(tiny, seed)
    assert max(case.prefix) > tiny.config.selected_tokens, "the sparse path must run"
    expected = case.run(InOrderExecutor())
    actual = case.run(AdversarialExecutor(seed=seed, mode=mode))
    assert torch.equal(actual, expected), "reordering side-stream work changed the logits"


@pytest.mark.parametrize("seed", range(3))
def test_stream_race_fault_is_exposed_by_the_emulator(tiny, seed):
    """Negative control: with the join dropped, attention reads a stale selection."""
    case = ExtendCase(tiny, seed)
    expected = case.run(InOrderExecutor())
    raced = case.run(AdversarialExecutor(seed=seed, mode="late"), faults=("stream-race",))
    assert not torch.equal(raced, expected), "the emulator failed to expose the missing join"


def test_stream_race_reads_a_stale_selection_not_just_poison(tiny):
    """With a workspace left over from an identical earlier step, the raced read finds plausible
    (finite) but stale selections: the output is wrong without any NaN to give it away."""
    case = ExtendCase(tiny, 0)
    expected = case.run(InOrderExecutor())
    model = case.model(("stream-race",))
    kv = KVCache.__new__(KVCache)
    kv.latent, kv.index_keys = case.kv.latent.clone(), case.kv.index_keys.clone()
    model.forward(case.batch, kv, AdversarialExecutor(mode="late"))  # leaves selections behind
    kv.latent, kv.index_keys = case.kv.latent.clone(), case.kv.index_keys.clone()
    raced = model.forward(case.batch, kv, AdversarialExecutor(mode="late"))
    assert torch.isfinite(raced).all()
    assert not torch.equal(raced, expected)


def test_stream_race_fault_is_invisible_in_order(tiny):
    """Why the emulator exists: on one in-order stream the missing join does no harm."""
    case = ExtendCase(tiny, 0)
    expected = case.run(InOrderExecutor())
    assert torch.equal(case.run(InOrderExecutor(), faults=("stream-race",)), expected)
