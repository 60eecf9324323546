"""Static happens-before checker: accepts the model's real stream program, rejects each hazard."""

from __future__ import annotations

import pytest

from runtime.streams.checker import HappensBeforeError, check_program, find_hazards
from runtime.streams.tasks import MAIN, InOrderExecutor, Task
from tests.utils import ExtendCase

pytestmark = pytest.mark.unit


def noop() -> None:
    pass


def model_program(tiny, faults=()):
    streams = InOrderExecutor(record_program=True)
    ExtendCase(tiny, 0).run(streams, faults=faults)
    return streams.program


def test_real_model_program_is_race_free(tiny):
    program = model_program(tiny)
    assert sum(isinstance(op, Task) for op in program) == 2 * tiny.config.num_layers
    check_program(program)


def test_missing_join_in_model_program_is_rejected(tiny):
    """Negative control: the `stream-race` program reads the selection unordered after its write."""
    hazards = find_hazards(model_program(tiny, faults=("stream-race",)))
    raw = [h for h in hazards if h.kind == "read-after-write" and h.buffer == "selection"]
    assert len(raw) == tiny.config.num_layers, hazards
    assert raw[0].first == "indexer.0" and raw[0].second == "attention.0"
    with pytest.raises(HappensBeforeError, match="selection"):
        check_program(model_program(tiny, faults=("stream-race",)))


def test_write_after_read_without_fork_is_rejected():
    ex = InOrderExecutor(record_program=True)
    ex.submit(Task("consume", MAIN, reads=("buf",), writes=(), fn=noop))
    ex.submit(Task("overwrite", "side", reads=(), writes=("buf",), fn=noop))  # no fork: may run first
    ex.join("side")
    assert [h.kind for h in find_hazards(ex.program)] == ["write-after-read"]


def test_write_after_write_and_unjoined_side_stream_are_rejected():
    ex = InOrderExecutor(record_program=True)
    ex.submit(Task("w1", MAIN, reads=(), writes=("buf",), fn=noop))
    ex.submit(Task("w2", "side", reads=(), writes=("buf",), fn=noop))
    kinds = sorted(h.kind for h in find_hazards(ex.program))
    assert kinds == ["unjoined", "write-after-write"]


def test_transitive_ordering_through_a_third_stream_is_accepted():
    """a -> b by an event, b -> main by a join: main's read of a's write is ordered."""
    ex = InOrderExecutor(record_program=True)
    ex.fork("a")
    ex.submit(Task("produce", "a", reads=(), writes=("buf",), fn=noop))
    ex.wait("b", ex.record("a"))
    ex.submit(Task("relay", "b", reads=(), writes=(), fn=noop))
    ex.join("b")
    ex.submit(Task("consume", MAIN, reads=("buf",), writes=(), fn=noop))
    check_program(ex.program)


def test_event_recorded_before_the_write_does_not_order_it():
    ex = InOrderExecutor(record_program=True)
    early = ex.record("side")  # covers nothing of side yet
    ex.submit(Task("produce", "side", reads=(), writes=("buf",), fn=noop))
    ex.wait(MAIN, early)
    ex.submit(Task("consume", MAIN, reads=("buf",), writes=(), fn=noop))
    ex.join("side")
    assert [h.kind for h in find_hazards(ex.program)] == ["read-after-write"]
