"""The gate against a server and model this project did not write (issue 17 item 4): llama.cpp's
OpenAI-compatible server (llama-cpp-python) with Gemma 3 270M (Q4_K_M GGUF from PyPI), on the CPU.
Opt-in (`make thirdparty`, or `-m thirdparty` with `CANARY_LLAMA_PYTHON` naming an interpreter that
has both): it needs llama-cpp-python built from source, and each gate here takes minutes.

What it shows:
- the healthy server passes the calibrated gate: 0 false alarms from the load-vs-solo replays and the
  solo reference, while the model's failures at the task (it is a 270M base model: it echoes no
  nonce and calls no tool) are reported as model quality (canary/calibration.py);
- corruption planted between harness and server by a proxy, only while two requests are in flight
  (tests/corrupting_proxy.py `UnderLoad`), is caught: a character changed in the answer text, two tokens
  swapped, another session's nonce in an answer, a stream without `[DONE]`;
- llama-cpp-python's own default `interrupt_requests` (a streamed answer cut short whenever another
  request waits) fails the gate under load and passes it alone;
- the perf verdict (interleaved A/B trials, `--baseline-url`) runs against it although it sends no
  usage chunk (tokens counted from the deltas) and with logprobs left out of the trials
  (`--perf-workload`): the server against itself is not called slower, and the server behind a proxy
  that holds each token back by a known delay is, against the same proxy with no delay.
"""

from __future__ import annotations

import pytest

from canary import thirdparty
from canary.driver import DriverOptions
from canary.gate import run_configured, run_gate
from canary.options import CanaryOptions
from canary.perf.ratio_stats import SLOWER
from canary.reports import summary_lines, write_summary
from canary.scenarios import make_scenario
from tests import corrupting_proxy as cp

pytestmark = [pytest.mark.e2e, pytest.mark.thirdparty]

# 4 sessions x 3 turns, half the requests streamed (each with its non-streamed reference), 8 tokens an
# answer: llama-cpp-python computes top logprobs by sorting Gemma's whole 262,144-token vocabulary in
# Python for every generated token (about 1 s a token here, against 0.2 s without logprobs), so a gate
# (calibration run, load run, every request replayed alone) takes about 5 minutes on the 2-core machine.
OPTIONS = dict(sessions=4, turns=3, stream_ratio=0.5, max_tokens=8, generic_prompts=True)
EVERY_REQUEST = 1000  # --differential-sample: replay every greedy request alone, not a sample


@pytest.fixture(scope="module")
def llama_python() -> str:
    python = thirdparty.llama_python()
    why = thirdparty.missing(python)
    if why:
        pytest.skip(f"third-party target unavailable: {why}")
    return python


@pytest.fixture(scope="module")
def gguf(llama_python):
    return thirdparty.gemma_gguf(llama_python)


@pytest.fixture(scope="module")
def llama(llama_python, gguf, tmp_path_factory):
    with thirdparty.llama_cpp_server(llama_python, gguf, log_dir=tmp_path_factory.mktemp("llama")) as target:
        yield target


def gate(target, report_dir=None, **options):
    outcome = run_gate(target, DriverOptions(**{**OPTIONS, **options}), progress=False, calibrate=True,
                       differential_sample=EVERY_REQUEST, perf_trials_min=0)
    if report_dir is not None:
        write_summary(report_dir, outcome.summary)
    return outcome


def test_healthy_server_passes_with_model_quality_reported_and_no_false_alarm(llama, canary_summary, tmp_path):
    outcome = gate(llama, tmp_path)
    canary_summary(summary_lines({**outcome.summary, "notes": outcome.notes}, outcome.failures, tmp_path))
    assert outcome.passed, "\n".join(outcome.failures[:20])
    calibration = outcome.summary["calibration"]
    # The model cannot do the task: the calibration run says so, and the load run is not blamed for it.
    alone = calibration["failed_alone"]
    assert alone.get("nonce-echo", {}).get("label") == "model quality", alone
    assert alone["nonce-echo"]["load_failures_excused"] > 0
    reference, replays = calibration["solo_reference"], outcome.summary["differential"]
    assert reference["compared"] >= OPTIONS["sessions"] and reference["failed"] == 0
    # The replays run alone only what the calibration run could not compare (a context moved under load).
    assert replays["compared_alone_in_calibration"] >= reference["compared"] and replays["failed"] == 0
    assert outcome.summary["metrics"]["completion_tokens"] > 0


def test_corruption_under_load_between_harness_and_server_is_caught(llama, canary_summary, tmp_path):
    nonces = [make_scenario(i, OPTIONS["turns"], True).nonce for i in range(OPTIONS["sessions"])]
    # Gemma 3 270M (base, llama-2 fallback template) answers its first turn with text and later turns
    # mostly with EOS at once (measured: 33 tokens in 12 requests), so the two text rewrites act from
    # the first turn on; bleed and the missing [DONE] need no text and are planted from the second.
    in_text = [cp.OneCharacter(), cp.SwapTokens()]
    for rewrite in in_text:
        rewrite.late = 1
    expected = {"OneCharacter": "[solo-reference]", "SwapTokens": "[solo-reference]",
                "ForeignNonce": "[cross-session-bleed]", "DropDone": "[stream-done]"}
    by_session = cp.BySession([*in_text, cp.ForeignNonce(nonces), cp.DropDone()], nonces)
    with cp.CorruptingProxy(llama.root_url) as proxy:
        proxy.rewrite = cp.UnderLoad(by_session, proxy)
        outcome = gate(proxy.target(llama.model), tmp_path)
    canary_summary(summary_lines({**outcome.summary, "notes": outcome.notes}, outcome.failures, tmp_path))
    assert not outcome.passed
    for kind, oracle in expected.items():
        changed = by_session.changed.get(kind, set())
        assert changed, f"{kind} changed no response under load: the control proves nothing"
        caught = {s for s in changed if any(line.startswith(oracle) and f"session {s} " in line
                                            for line in outcome.failures)}
        assert caught, f"{kind} (sessions {sorted(changed)}) went unnoticed by {oracle}"
    # Nothing is corrupted alone: the calibration run passed every oracle it holds the server to.
    assert not any(line.startswith("alone (calibration run)") for line in outcome.failures)
    late = {s for kind in ("ForeignNonce", "DropDone") for s in by_session.changed.get(kind, ())}
    assert not any(f"session {s} turn 0" in line for s in late for line in outcome.failures), outcome.failures


def test_llama_cpp_default_interrupt_requests_fails_under_load_not_alone(llama_python, gguf, canary_summary,
                                                                        tmp_path):
    """With its default `interrupt_requests`, llama-cpp-python ends a streamed answer as soon as another
    request waits: `[DONE]` without a finish_reason. Alone nothing waits, so the calibration run passes
    the protocol oracles and the load run's truncated streams are corruption."""
    with thirdparty.llama_cpp_server(llama_python, gguf, interrupt_requests=True, log_dir=tmp_path) as target:
        outcome = run_gate(target, DriverOptions(**{**OPTIONS, "sessions": 3, "turns": 1, "stream_ratio": 1.0}),
                           progress=False, calibrate=True, differential_sample=0, perf_trials_min=0)
    canary_summary(summary_lines({**outcome.summary, "notes": outcome.notes}, outcome.failures))
    fired = {line.split("]")[0] + "]" for line in outcome.failures}
    assert not outcome.passed and "[finish-reason]" in fired, outcome.failures
    assert not any(line.startswith("alone (calibration run)") for line in outcome.failures)
    assert "finish-reason" not in outcome.summary["calibration"]["failed_alone"]


# The perf trials against this server: one request at a time is all it serves (one slot), so one
# concurrency level; 16 tokens (~45 ms each here without logprobs), the median of 3; TTFT of 3
# requests at 1 per second (a prefill takes ~0.85 s). About 5 s a trial on the 2-core machine.
PERF_WORKLOAD = {"concurrency": [1], "max_tokens": 16, "ttft_rate": 1.0, "ttft_requests": 3, "rounds": 3,
                 "logprobs": False}
PERF_TOLERANCE = 0.2
TOKEN_DELAY_S = 0.05  # the slowed side: about twice this server's decode step here, far past the tolerance


def ab_gate(candidate_url: str, baseline_url: str, report_dir):
    """`pytest -m stress --base-url CANDIDATE --baseline-url BASELINE --perf-workload ...` in small: 2
    calibrated sessions of one turn, then 4 to 8 interleaved trial pairs."""
    options = CanaryOptions(sessions=2, turns=1, concurrency=None, base_url=candidate_url,
                            model=thirdparty.MODEL_ALIAS, api_key=None, stream_ratio=0.5, abort_ratio=0.0, faults=(),
                            baseline=None, baseline_url=baseline_url, perf_tolerance=PERF_TOLERANCE,
                            report_dir=report_dir, golden_update=False, baseline_update=False, sweep=False,
                            max_tokens=4, perf_trials=4, perf_workload=PERF_WORKLOAD)
    from canary.targets import remote_target

    return run_configured(options, remote_target(candidate_url, thirdparty.MODEL_ALIAS))


def perf_facts(outcome) -> list[str]:
    ab = outcome.summary["ab"]
    counted = sorted({k for t in ab["trials"] for k in t.get("tokens_counted", {})})
    return [f"  A/B trials: {len(ab['trials'])} ({ab['candidate']} vs {ab['baseline']}), tokens counted from: "
            f"{counted}, workload {ab['workload']}"] + [
        f"  {v['metric']}: {v['status']}, cost ratio {v['ratio']:.3f} [{v['low']:.3f}, {v['high']:.3f}], "
        f"{v['trials']} pairs ({v['reason']})" for v in ab["verdicts"]]


def test_perf_ab_against_itself_is_not_slower_and_a_slowed_server_is(llama, canary_summary, tmp_path):
    clean = ab_gate(llama.base_url, llama.base_url, tmp_path / "clean")
    canary_summary(summary_lines(clean.summary, clean.failures, clean.report) + perf_facts(clean))
    ab = clean.summary["ab"]
    # llama-cpp-python 0.3.36 sends no usage chunk: every trial counted its tokens from the deltas.
    assert ab["trials"] and all(set(t["tokens_counted"]) == {"deltas"} for t in ab["trials"]), ab["trials"][:2]
    assert ab["status"] != SLOWER, "\n".join(clean.failures)
    # Correctness passed (model quality calibrated away); only a too-noisy perf verdict may fail it.
    assert all(line.startswith("[perf-inconclusive]") for line in clean.failures), clean.failures

    with cp.CorruptingProxy(llama.root_url) as base, cp.CorruptingProxy(llama.root_url) as slow:
        base.token_delay_s, slow.token_delay_s = 0.0, TOKEN_DELAY_S
        slowed = ab_gate(slow.target(llama.model).base_url, base.target(llama.model).base_url, tmp_path / "slowed")
    canary_summary(summary_lines(slowed.summary, slowed.failures, slowed.report) + perf_facts(slowed))
    assert slow.delayed_tokens > 0
    assert slowed.summary["ab"]["status"] == SLOWER, "\n".join(slowed.failures)
    assert any(line.startswith("[perf-regression] A/B decode_tok_s@1") for line in slowed.failures), slowed.failures
    assert all(line.startswith("[perf-") for line in slowed.failures), slowed.failures  # the delay corrupts nothing
