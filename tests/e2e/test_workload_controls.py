"""Negative controls for the gate's workload mix (canary/workload.py) and the checks it feeds: each
planted runtime fault (runtime/faults.py) against the embedded canary runtime trips its check, and
the check that would have missed it is shown missing it.

- indexer-window-off-by-one keeps every token and moves logprobs: the golden store's logprob check
  fails it while its token comparison (the oracle before this check) passes every request;
- abort-leak: client aborts leave KV pages behind, and the gate's leak check fails;
- prefix-cache-stale-page: a cache hit copies one page's KV from the wrong entry; the golden store fails it;
- a small pool that does not preempt fails `[preemption]`, one that does passes with a count.
The probes run on every session here (ratios 1.0); their golden keys do not depend on the ratios.
stop-string-kept ([stop-string]) and shared-sampling-generator ([load-vs-solo] on the seeded probes)
are rows of the fault matrix (tests/e2e/test_fault_matrix.py, canary/faults/detectors.py), whose
canary-gate workload runs the same probes.
"""

from __future__ import annotations

import dataclasses

import pytest

from canary.driver import DriverOptions
from canary.gate import run_gate
from canary.options import CanaryOptions
from canary.small_pool import small_pool_gate
from canary.targets import embedded_server
from canary.workload import DEFAULT_ABORT_RATIO, DEFAULT_SMALL_POOL_PAGES
from runtime.config import DEFAULT_MODEL

pytestmark = pytest.mark.e2e

MIX = DriverOptions(sessions=12, turns=2, stream_ratio=0.5, max_tokens=160, abort_ratio=DEFAULT_ABORT_RATIO,
                    sampled_ratio=1.0, stop_ratio=1.0, multibyte_ratio=1.0)


def tags(failures: list[str]) -> set[str]:
    return {line.split("]")[0] + "]" for line in failures}


def gate(tmp_path, faults, options=MIX, **kwargs):
    with embedded_server(DEFAULT_MODEL, faults=faults, log_dir=tmp_path) as target:
        return run_gate(target, options, progress=False, perf_gate=False, **kwargs)


def test_indexer_off_by_one_fails_on_logprobs_and_passes_on_tokens(tmp_path):
    outcome = gate(tmp_path, ["indexer-window-off-by-one"], dataclasses.replace(MIX, sessions=16),
                   differential_sample=0)
    golden = outcome.summary["golden"]
    assert golden["checked"] >= 30 and golden["logprob_atol"] is not None
    drifted = [line for line in outcome.failures if line.startswith("[golden-logprob]")]
    assert drifted, outcome.failures
    # The negative control: every token still matches, so the token-only golden check (and every
    # other oracle) passes this run; only the logprob comparison fails it.
    assert tags(outcome.failures) == {"[golden-logprob]"}, outcome.failures


def test_prefix_cache_stale_page_fails_the_golden_check(tmp_path):
    """A later turn's prompt starts with its session's earlier turns, whose cached pages it copies:
    one of them copied from the wrong cache entry must move the golden transcripts."""
    outcome = gate(tmp_path, ["prefix-cache-stale-page"], differential_sample=0)
    assert {"[golden]", "[golden-logprob]"} & tags(outcome.failures), outcome.failures
    assert outcome.summary["prefix_cache"]["hit_tokens"] > 0


def test_abort_leak_fails_the_kv_leak_check_and_aborted_sessions_are_counted(tmp_path):
    options = dataclasses.replace(MIX, abort_ratio=0.5, sampled_ratio=0.0, stop_ratio=0.0, multibyte_ratio=0.0)
    outcome = gate(tmp_path, ["abort-leak"], options, differential_sample=0)
    assert "[kv-leak]" in tags(outcome.failures), outcome.failures
    assert outcome.summary["sessions_aborted"] >= 1
    aborted = [end for end in outcome.summary["session_ends"] if end["status"] == "aborted"]
    assert len(aborted) == outcome.summary["sessions_aborted"]
    assert all("client abort mid-stream at request" in end["reason"] for end in aborted)


def test_clean_mix_passes_with_aborts_counted_and_probes_checked(tmp_path):
    outcome = gate(tmp_path, [], dataclasses.replace(MIX, abort_ratio=0.3), differential_sample=4)
    assert outcome.passed, outcome.failures
    s = outcome.summary
    assert s["sessions_aborted"] >= 1 and s["sessions_completed"] + s["sessions_aborted"] == MIX.sessions
    assert s["oracle_checks"]["stop-string"] >= 4 and s["kv_pages_in_use"] == 0
    assert s["differential"]["seeded_sampling"] >= 4 and s["differential"]["failed"] == 0


def small_pool(pages: int) -> CanaryOptions:
    return CanaryOptions(sessions=8, turns=2, concurrency=None, base_url=None, model=None, api_key=None,
                         stream_ratio=0.5, abort_ratio=DEFAULT_ABORT_RATIO, faults=(), baseline=None, baseline_url=None,
                         perf_tolerance=0.5, report_dir=None, golden_update=False, baseline_update=False, sweep=False,
                         max_tokens=160, differential_sample=2, small_pool_pages=pages, sampled_ratio=0.1,
                         stop_ratio=0.1, multibyte_ratio=0.1)


def test_small_pool_preempts_and_a_big_one_fails_the_preemption_check(tmp_path):
    # The gate's own small pool: it must preempt on this workload too (a pool below one prompt's
    # pages would instead reject requests with a 400).
    outcome = small_pool_gate(small_pool(DEFAULT_SMALL_POOL_PAGES), DEFAULT_MODEL, [], tmp_path)
    assert outcome.passed, outcome.failures
    assert outcome.summary["preemptions"] > 0 and outcome.summary["golden"]["checked"] > 0
    idle = small_pool_gate(small_pool(4096), DEFAULT_MODEL, [], tmp_path)
    assert idle.summary["preemptions"] == 0
    assert [line for line in idle.failures if line.startswith("[preemption]")], idle.failures
