"""The declared-stream API: tasks run in order and the program records fork/join events."""

from __future__ import annotations

import pytest

from runtime.streams.tasks import MAIN, Event, InOrderExecutor, Task, Wait

pytestmark = pytest.mark.unit


def test_in_order_executor_runs_at_submission_and_records_the_program():
    ran = []
    ex = InOrderExecutor(record_program=True)
    ex.fork("side")
    ex.submit(Task("idx", "side", reads=("h",), writes=("sel",), fn=lambda: ran.append("idx")))
    ex.join("side")
    ex.submit(Task("attn", MAIN, reads=("sel",), writes=("out",), fn=lambda: ran.append("attn")))
    assert ran == ["idx", "attn"]
    kinds = [type(op).__name__ for op in ex.program]
    assert kinds == ["Event", "Wait", "Task", "Event", "Wait", "Task"]
    join = ex.program[4]
    assert join == Wait(MAIN, Event("side", 1)), "the join covers the one side task submitted before it"


def test_program_is_not_kept_unless_asked():
    ex = InOrderExecutor()
    ex.fork("side")
    ex.submit(Task("t", "side", (), (), fn=lambda: None))
    assert ex.program == []
