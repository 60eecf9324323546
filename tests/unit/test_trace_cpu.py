"""A traced span's thread-CPU marks (Trace.mark_cpu) and bench.pd_phases' reading of them: what tells a
phase that waited from one that worked (the PD prefill server's template + tokenize on the H200)."""

from __future__ import annotations

import threading
import time

import pytest

from bench.pd_phases import cpu_and_wall_ms, tokenize_core_sharing
from runtime.server import trace as trace_module
from runtime.server.trace import NO_TRACE, Trace, TraceLog


def _span(trace: Trace, work) -> None:
    trace.mark("parsed")
    trace.mark_cpu("parsed")
    work()
    trace.mark_cpu("prepared")
    trace.mark("prepared")


def _busy(cpu_seconds: float) -> None:
    """Spin until this thread has used `cpu_seconds` of CPU: a span of known CPU time however loaded
    the host is (spinning for a wall-clock time got 5 ms of CPU in 97 ms beside a CI run here)."""
    end = time.thread_time() + cpu_seconds
    while time.thread_time() < end:
        pass


def _busy_until_others_ran(cpu_seconds: float, limit_s: float = 30.0) -> None:
    """Spin until the process's other threads have used `cpu_seconds` of CPU since the call (or
    `limit_s` passed): the span then holds that much of their CPU however the host schedules them."""
    others = time.process_time() - time.thread_time()
    deadline = time.monotonic() + limit_s
    while time.process_time() - time.thread_time() - others < cpu_seconds and time.monotonic() < deadline:
        pass


def test_a_span_that_waits_shows_its_wall_time_but_not_as_cpu() -> None:
    waited, worked = Trace("a"), Trace("b")
    _span(waited, lambda: time.sleep(0.05))  # the control: a sleeping span is not CPU
    _span(worked, lambda: _busy(0.05))
    rows = [{f"prefill.{k}": v for k, v in waited.marks.items()}, {f"server.{k}": v for k, v in worked.marks.items()}]
    figures = cpu_and_wall_ms(rows)
    prefill, colocated = figures["prefill: template, tokenize"], figures["colocated: template, tokenize"]
    assert prefill["wall_ms"] >= 50 and prefill["cpu_ms"] < 10
    assert colocated["cpu_ms"] >= 45 and colocated["wall_ms"] >= colocated["cpu_ms"] - 1
    assert "decode: template, tokenize" not in figures  # no marks from that side: no row


def test_a_span_that_waits_for_another_thread_of_its_process_shows_that_threads_cpu() -> None:
    contended, alone = Trace("a"), Trace("b")
    stop = threading.Event()

    def spin() -> None:  # pure Python: it holds the GIL for its switch intervals
        while not stop.is_set():
            pass

    spinner = threading.Thread(target=spin, daemon=True)
    spinner.start()
    try:
        _span(contended, lambda: _busy_until_others_ran(0.02))
    finally:
        stop.set()
        spinner.join()
    _span(alone, lambda: _busy(0.05))  # the control: nothing else of this process runs
    figures = cpu_and_wall_ms([{f"prefill.{k}": v for k, v in contended.marks.items()},
                               {f"server.{k}": v for k, v in alone.marks.items()}])
    assert figures["prefill: template, tokenize"]["other_threads_cpu_ms"] > 10
    assert figures["colocated: template, tokenize"]["other_threads_cpu_ms"] < 5


def test_cpu_marks_are_kept_apart_from_the_monotonic_ones_and_untraced_requests_make_none() -> None:
    trace = TraceLog().start({"x-dsv4-trace": "k"})
    _span(trace, lambda: None)
    on_cpu = {"parsed@on", "prepared@on"} if trace_module._current_cpu is not None else set()
    assert set(trace.marks) == {"parsed", "parsed@cpu", "parsed@proc", "prepared@cpu", "prepared@proc", "prepared",
                                *on_cpu}
    _span(NO_TRACE, lambda: None)
    assert NO_TRACE.marks == {}


@pytest.mark.skipif(trace_module._current_cpu is None, reason="sched_getcpu is Linux's")
def test_a_cpu_mark_names_a_cpu_this_process_may_run_on() -> None:
    import os

    trace = Trace("k")
    trace.mark_cpu("parsed")
    assert int(trace.marks["parsed@on"]) in os.sched_getaffinity(0)


def _pd_row(prefill: tuple[float, float, int, int, float], decode: tuple[float, float, int, int, float]) -> dict:
    """A PD request's marks: per side (span start, span end, CPU at start, CPU at end, loop-thread CPU seconds)."""
    row: dict[str, float] = {}
    for side, (start, end, cpu_start, cpu_end, cpu_s) in (("prefill", prefill), ("decode", decode)):
        row |= {f"{side}.parsed": start, f"{side}.prepared": end, f"{side}.parsed@on": cpu_start,
                f"{side}.prepared@on": cpu_end, f"{side}.parsed@cpu": 10.0, f"{side}.prepared@cpu": 10.0 + cpu_s}
    return row


def test_tokenize_spans_are_split_by_whether_they_ran_at_once_on_one_core() -> None:
    core_of = {0: 0, 8: 0, 1: 1, 9: 1}  # SMT siblings 0/8 and 1/9
    rows = [
        _pd_row((0.0, 0.012, 0, 0, 0.012), (0.001, 0.007, 8, 8, 0.006)),  # at once on siblings: shared
        _pd_row((1.0, 1.006, 0, 0, 0.006), (1.001, 1.007, 1, 1, 0.006)),  # at once, other cores: apart
        _pd_row((2.0, 2.006, 0, 0, 0.006), (2.010, 2.016, 8, 8, 0.006)),  # siblings, one after the other: apart
        _pd_row((3.0, 3.012, 1, 0, 0.012), (3.001, 3.007, 9, 9, 0.006)),  # moved off the shared core mid-span
    ]
    sharing = tokenize_core_sharing(rows, core_of)
    assert sharing == {"shared_core": 2, "apart": 2, "prefill_cpu_ms_shared_core": 12.0,
                       "decode_cpu_ms_shared_core": 6.0, "prefill_cpu_ms_apart": 6.0, "decode_cpu_ms_apart": 6.0}
    # Rows without CPU numbers (a host without sched_getcpu) or without a PD side: nothing to split.
    assert tokenize_core_sharing([{k: v for k, v in rows[0].items() if not k.endswith("@on")}], core_of) is None
    assert tokenize_core_sharing([{k: v for k, v in rows[0].items() if k.startswith("prefill")}], core_of) is None
