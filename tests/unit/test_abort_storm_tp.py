"""Abort storm at TP=2 with the overlap loop on: thousands of steps of random arrivals and aborts
(while waiting, right after admission, inside the overlap window, twice, after finishing) under a
pool small enough to force preemption. Zero hangs (every collective is bounded by the timeout and
the watchdog, and the plan check runs every step), zero leaked pages or slots on every rank."""

from __future__ import annotations

import random

import pytest

from runtime.config import EngineConfig
from runtime.distributed.tp_engine import start_engine
from runtime.engine.request import SamplingParams
from runtime.env import Env
from runtime.faults import FaultSet
from runtime.models.loader import load_model

pytestmark = pytest.mark.unit

STEPS = 2000


def test_abort_storm_tp2_overlap_no_hang_no_leak():
    tiny = load_model("tiny-random")
    rng = random.Random(2024)
    env = Env(tp_check=True, tp_timeout_s=30.0, num_threads=1)
    cfg = EngineConfig(num_pages=10, page_size=4, max_running_requests=6, max_model_len=40, max_prefill_tokens=40)
    with start_engine(tiny, cfg, faults=FaultSet(), env=env, overlap=True, tp=2) as engine:
        live: list[str] = []
        aborted = 0
        for _ in range(STEPS):
            if rng.random() < 0.6:
                prompt = [rng.randrange(256) for _ in range(rng.randint(1, 10))]
                params = SamplingParams(max_tokens=rng.randint(1, 14), ignore_eos=True,
                                        temperature=rng.choice([0.0, 1.0]), seed=rng.randrange(1 << 30))
                live.append(engine.add_request(prompt, params))
            if live and rng.random() < 0.35:
                rid = rng.choice(live)
                aborted += engine.abort(rid)
                if rng.random() < 0.2:
                    engine.abort(rid)  # a second abort of the same request is a no-op
            engine.step()
            live = [rid for rid in live if not engine.scheduler.requests[rid].finished]
        engine.run_until_done()
        sched = engine.scheduler
        finished = list(sched.requests.values())
        reasons = [r.finish_reason for r in finished]
        assert all(r.finished for r in finished)
        assert sched.step >= 0.9 * STEPS, "the storm must really run thousands of steps"
        assert reasons.count("abort") > 100 and reasons.count("length") > 100
        assert sched.aborts_in_flight > 20, "aborts must land inside the overlap window"
        assert sched.num_preemptions > 0, "the pool must be small enough to force preemption"
        assert engine.pages_in_use == 0
        for stats in engine.tp.rank_stats():
            assert stats == {"rank": stats["rank"], "pages_in_use": 0, "requests": 0, "future_slots": 0}
        assert engine.runner.future.live == 0
        print(f"storm: {sched.step} steps, {reasons.count('abort')} aborts ({sched.aborts_in_flight} in flight), "
              f"{sched.num_preemptions} preemptions, {reasons.count('length')} completed")
