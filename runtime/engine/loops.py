"""The two scheduler loops, side by side: `normal_step` and `overlap_step` (one iteration each).

normal:  schedule N -> execute N -> postprocess N.
overlap: schedule N+1 -> launch N+1 -> postprocess N (which ran while the CPU scheduled N+1).

In the overlap loop the scheduler plans N+1 without N's tokens: decode inputs come from the
device-side `FutureTokens` buffer, a request whose in-flight token will finish it by length is
not scheduled again, and a row whose request finished or was aborted before the row was
processed is discarded (counted in `Scheduler.discarded_rows`), so no token is lost or
duplicated. The same workload gives the same tokens and logprobs in both loops.

On CPU "launch" computes eagerly; what the loop preserves is the data flow of the device version:
the scheduler never reads step N's results before it has planned step N+1.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from runtime.engine.plan import StepPlan
from runtime.engine.sampler import SampleOutput

if TYPE_CHECKING:
    from runtime.engine.engine import Engine, StepResult


@dataclass(frozen=True)
class Launched:
    """A step handed to the device whose results the CPU has not looked at yet."""

    plan: StepPlan
    outputs: dict[str, SampleOutput]


def deliverable(engine: "Engine", outputs: dict[str, SampleOutput]) -> dict[str, SampleOutput]:
    """The outputs postprocess will append: not those of requests that finished (or were aborted)
    while their row was in flight. Callers stream exactly these, so no token is sent twice."""
    requests = engine.scheduler.requests
    return {rid: out for rid, out in outputs.items() if rid in requests and not requests[rid].finished}


def normal_step(engine: "Engine") -> "StepResult":
    started = time.perf_counter()
    plan = engine.scheduler.schedule()
    outputs = engine.dispatch(plan)
    delivered = deliverable(engine, outputs)
    engine.scheduler.postprocess(plan, outputs)
    return engine.finish_step(plan, delivered, started)


def overlap_step(engine: "Engine") -> "StepResult":
    started = time.perf_counter()
    launched = None
    if engine.scheduler.has_work:
        plan = engine.scheduler.schedule()
        launched = Launched(plan, engine.dispatch(plan))
    last, engine.in_flight = engine.in_flight, launched
    if last is None:  # the first step of a burst (or an idle call): nothing has landed yet
        plan = launched.plan if launched else StepPlan(engine.scheduler.step, (), ())
        return engine.finish_step(plan, {}, started)
    delivered = deliverable(engine, last.outputs)
    engine.scheduler.postprocess(last.plan, last.outputs)
    return engine.finish_step(last.plan, delivered, started)
