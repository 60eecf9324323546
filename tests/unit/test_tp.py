"""Tensor parallelism on CPU (gloo): TP=2 vs TP=1, the plan check, the watchdog, the near-tie check.

Each TP engine spawns one worker process, so the tests share as few engines as they can.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading

import pytest
from test_overlap import drive_like_the_server, make_workload, run

from canary.oracles.logprob_close import Generation, NotClose, check_logprobs_close
from runtime.config import EngineConfig
from runtime.distributed.errors import CollectiveError, DesyncError
from runtime.distributed.tp_engine import start_engine
from runtime.distributed.worker import LOCAL_ABORT_STEP
from runtime.engine.engine import Engine
from runtime.engine.request import SamplingParams
from runtime.env import Env
from runtime.faults import FaultSet

pytestmark = pytest.mark.unit

# float32, reductions split across 2 ranks: logprobs agree to ~1e-6; a near-tie is a flip between
# two tokens whose logprobs are this close on both sides.
LOGPROB_ATOL = 1e-4
NEAR_TIE_MARGIN = 1e-3


def generations(reqs) -> list[Generation]:
    return [Generation(r.output_ids, r.output_logprobs, r.output_top_logprobs) for r in reqs]


def exact_workload():
    # Aborts by delivered-token count only, so every run delivers the same number of tokens.
    return [dataclasses.replace(it, abort_at=None) for it in make_workload(21, 18, aborts=True)]


def tp_engine(tiny, faults=(), overlap=False, **env) -> Engine:
    env = Env(tp_check=True, num_threads=1, **{"tp_timeout_s": 30.0, **env})
    return start_engine(tiny, EngineConfig(num_pages=64, page_size=4), faults=FaultSet(faults), env=env,
                        overlap=overlap, tp=2)


def assert_workers_gone(engine: Engine) -> None:
    for pid in engine.tp.worker_pids:
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z", \
            f"worker {pid} outlived the engine"


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_tp2_matches_tp1_up_to_near_ties(tiny, overlap):
    items = exact_workload()
    _, reference, _ = run(tiny, items, overlap=False, num_pages=64, page_size=4)
    with tp_engine(tiny, overlap=overlap) as engine:
        reqs, _ = drive_like_the_server(engine, items)
        assert engine.pages_in_use == 0
        assert engine.tp.rank_stats() == [{"rank": 1, "pages_in_use": 0, "requests": 0, "future_slots": 0}]
    assert_workers_gone(engine)
    assert [r.finish_reason for r in reqs] == [r.finish_reason for r in reference]
    ties = check_logprobs_close(generations(reference), generations(reqs), margin=NEAR_TIE_MARGIN,
                                logprob_atol=LOGPROB_ATOL)
    compared = sum(len(r.output_ids) for r in reqs)
    assert compared >= 100 and len(ties) <= 2, f"near-ties {ties} over {compared} tokens"
    assert sum(r.finish_reason == "abort" for r in reqs) >= 3


def test_tp_local_abort_raises_desync_within_one_step(tiny):
    items = exact_workload()
    plans = []
    engine = tp_engine(tiny, faults=["tp-local-abort"], overlap=True)
    dispatch = engine.dispatch
    engine.dispatch = lambda plan: (plans.append(plan), dispatch(plan))[1]
    try:
        with pytest.raises(DesyncError) as caught:
            drive_like_the_server(engine, items)
    finally:
        engine.shutdown()
    assert_workers_gone(engine)
    faulty_step = next(p.step for p in plans if p.step >= LOCAL_ABORT_STEP and p.decode)
    assert caught.value.step == faulty_step == plans[-1].step, "caught at the step the rank went its own way"
    assert {"decode", "aborted"} <= set(caught.value.differing)
    assert f"step {faulty_step}" in str(caught.value) and "decode" in str(caught.value)


def test_a_stuck_rank_becomes_an_error_not_a_hang(tiny):
    engine = tp_engine(tiny, tp_timeout_s=2.0, tp_watchdog_grace_s=30.0)
    outcome: dict = {}

    def steps() -> None:
        try:
            while engine.has_work:
                engine.step()
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            outcome["error"] = exc

    try:
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True))
        engine.step()
        os.kill(engine.tp.worker_pids[0], signal.SIGSTOP)  # the peer is alive but never answers
        runner = threading.Thread(target=steps, daemon=True)
        runner.start()
        runner.join(120)  # hang guard only: the collective timeout is 2 s
        assert not runner.is_alive(), "a stuck peer hung rank 0"
    finally:
        engine.shutdown()  # escalates to SIGKILL: a stopped process ignores SIGTERM
    assert_workers_gone(engine)
    error = outcome.get("error")
    assert isinstance(error, CollectiveError) and error.timed_out, repr(error)
    assert "rank 0" in str(error) and "step" in str(error)


def test_near_tie_check_rejects_real_divergences(tiny):
    top = [[(5, -0.6931), (7, -0.6932)], [(1, -0.1), (2, -3.0)]]
    ref = Generation([5, 1], [-0.6931, -0.1], top)
    tie = Generation([7, 2], [-0.6932, -0.2], [[(7, -0.6931), (5, -0.6932)], [(2, -0.2), (1, -0.3)]])
    assert [t.position for t in check_logprobs_close([ref], [tie], margin=1e-3, logprob_atol=1e-4)] == [0]
    far = Generation([1, 1], [-0.1, -0.1], [[(1, -0.1), (5, -3.0)], top[1]])
    with pytest.raises(NotClose, match="not in each other's top"):
        check_logprobs_close([ref], [far], margin=1e-3, logprob_atol=1e-4)
    drift = Generation([5, 1], [-0.6931, -0.11], top)
    with pytest.raises(NotClose, match="logprob"):
        check_logprobs_close([ref], [drift], margin=1e-3, logprob_atol=1e-4)
    wide = Generation([7, 1], [-0.5, -0.1], [[(7, -0.5), (5, -0.9)], top[1]])
    with pytest.raises(NotClose, match="gaps"):
        check_logprobs_close([ref], [wide], margin=1e-3, logprob_atol=1e-4)
    # And on real runs: the stale-token bug is not a near-tie.
    items = exact_workload()
    _, normal, _ = run(tiny, items, overlap=False)
    _, stale, _ = run(tiny, items, overlap=True, faults=["overlap-stale-token"])
    with pytest.raises(NotClose):
        check_logprobs_close(generations(normal), generations(stale), margin=NEAR_TIE_MARGIN,
                             logprob_atol=LOGPROB_ATOL)


def test_watchdog_ends_a_rank_stuck_past_its_deadline():
    """Backstop for a backend that never times out: the rank prints where it is stuck and exits."""
    import subprocess
    import sys

    from runtime.distributed.collectives import WATCHDOG_EXIT_CODE

    code = ("import time; from runtime.distributed.collectives import Watchdog\n"
            "w = Watchdog(rank=3, timeout_s=0.2, grace_s=0.1); w.arm('all_reduce', 17); time.sleep(60)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == WATCHDOG_EXIT_CODE
    assert "rank 3 stuck in all_reduce at step 17" in proc.stderr


def test_mirror_pool_refuses_a_page_another_request_holds():
    from runtime.distributed.mirror_pool import MirrorPool
    from runtime.kvcache.page_pool import PageAccountingError

    pool = MirrorPool(num_pages=8, page_size=4)
    pool.claim("a", 0, (0, 1))
    pool.claim("a", 2, (2,))  # plans carry page-table deltas
    with pytest.raises(PageAccountingError):
        pool.claim("b", 0, (2,))
    with pytest.raises(PageAccountingError):
        pool.check_owned("b", [0])
    with pytest.raises(PageAccountingError, match="appends pages at 2, this rank holds 3"):
        pool.claim("a", 2, (4,))  # a delta that does not continue the held pages
    pool.check_table("a", (), 3)
    with pytest.raises(PageAccountingError, match="has 4 pages, this rank holds 3"):
        pool.check_table("a", (), 4)
    pool.release("a")
    pool.claim("b", 0, (2,))
    assert pool.pages_in_use == 1
