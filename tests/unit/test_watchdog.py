"""The soak's hang guard: results and exceptions pass through; a stalled or overlong call ends
in a HangError instead of an endless wait."""

from __future__ import annotations

import threading

import pytest

from canary.soak.watchdog import HangError, run_with_watchdog

pytestmark = pytest.mark.unit


def test_result_and_exception_pass_through():
    assert run_with_watchdog(lambda: 42, deadline_s=60, stall_s=60, progress=lambda: 0) == 42

    def boom():
        raise ValueError("from the worker")

    with pytest.raises(ValueError, match="from the worker"):
        run_with_watchdog(boom, deadline_s=60, stall_s=60, progress=lambda: 0)


def test_a_call_without_progress_is_a_stall():
    release = threading.Event()
    try:
        with pytest.raises(HangError, match="no progress for"):
            run_with_watchdog(release.wait, deadline_s=600, stall_s=0.3, progress=lambda: 7, poll_s=0.05)
    finally:
        release.set()


def test_a_call_that_keeps_progressing_still_meets_the_deadline():
    release = threading.Event()
    done = [0]

    def busy() -> None:
        while not release.wait(0.01):
            done[0] += 1

    try:
        with pytest.raises(HangError, match="deadline"):
            run_with_watchdog(busy, deadline_s=0.5, stall_s=600, progress=lambda: done[0], poll_s=0.05)
    finally:
        release.set()


def test_ticks_report_while_running():
    release = threading.Event()
    ticks: list[float] = []

    def work() -> str:
        release.wait(0.6)
        return "done"

    assert run_with_watchdog(work, deadline_s=60, stall_s=60, progress=lambda: 0, on_tick=ticks.append,
                             tick_s=0.1, poll_s=0.02) == "done"
    assert ticks and ticks == sorted(ticks)
