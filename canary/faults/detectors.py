"""Which gate catches which fault: `DETECTORS` maps every fault of runtime/faults.py to its gates.

The server gates start the embedded runtime with the canary model (the only model with golden
transcripts) on a small workload; the engine, GPU and PD gates live in canary/faults/engine_gates.py,
canary/faults/gpu_gates.py and canary/faults/pd_gates.py. Each detector says which failure lines are
its gate firing for its own reason: the canary gate's correctness oracles (anything but a perf
regression), the A/B gate's `[perf-regression]`, the tag each in-process comparison writes, and the PD
gate's named checks.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from canary.faults import engine_gates, gpu_gates, pd_gates
from canary.faults.matrix import Detector, GateResult
from runtime.config import DEFAULT_MODEL

# Small workloads (the 80-session gate is `make gate`): big enough that each fault shows in every
# run measured so far, small enough that the whole matrix stays within a few CPU minutes.
# (DriverOptions fields; kept as plain values so that the GPU-only form of the matrix imports no
# HTTP client: the device image has none.)
# Client aborts among the streams, so a fault in the abort path (abort-leak) has something to break.
# The probes of canary/workload.py on every session, so the stop-string and sampling faults show.
CANARY_WORKLOAD: dict[str, Any] = dict(sessions=16, turns=2, stream_ratio=0.5, max_tokens=160, abort_ratio=0.2,
                                       sampled_ratio=1.0, stop_ratio=1.0, multibyte_ratio=1.0)
AB_WORKLOAD: dict[str, Any] = dict(sessions=8, turns=1, stream_ratio=1.0, max_tokens=160)
AB_PAIRS = 4  # perf trial pairs, interleaved (canary/perf/trials.py): a load spike on the shared CPU hits both
# More pairs only while the verdict is inconclusive. A CI runner's clean control read [-15.5%, +27.0%]
# after 6 pairs (one pair's log-ratio sd ~0.2 there): inconclusive at 50%, i.e. an alarm. At 12 pairs
# that spread puts the verdict's one-sided bound ~0.23 from the mean, under the 0.41 (log 1.5) that an
# "ok" needs.
AB_MAX_PAIRS = 12
# Decode rates only: slow-step slows every step, and TTFT was the noisiest figure on a busy CPU
# (a clean A/B read [-23%, +44%] on it). Plain values, like the workloads above.
AB_TRIAL_WORKLOAD: dict[str, Any] = dict(concurrency=(1, 8), max_tokens=48, ttft_rate=0.0, rounds=3)
PERF_TOLERANCE = 0.5  # slow-step's 50 ms a step is far beyond it; the clean control stays quiet on a busy CPU


def canary_gate(faults: tuple[str, ...], seed: int, workdir: Path) -> GateResult:
    from canary.driver import DriverOptions
    from canary.gate import run_gate
    from canary.targets import embedded_server

    started = time.perf_counter()
    with embedded_server(DEFAULT_MODEL, faults=faults, log_dir=workdir / "servers") as target:
        setup = time.perf_counter() - started
        started = time.perf_counter()
        outcome = run_gate(target, DriverOptions(**CANARY_WORKLOAD, seed=seed), perf_tolerance=PERF_TOLERANCE,
                           progress=False, perf_trials_min=0)  # correctness only: speed is the A/B gate's
    return GateResult(outcome.failures, time.perf_counter() - started, setup)


def ab_perf_gate(faults: tuple[str, ...], seed: int, workdir: Path) -> GateResult:
    """The candidate (with the fault) against a clean baseline server, interleaved."""
    from canary.driver import DriverOptions
    from canary.gate import run_ab
    from canary.perf.trial_load import TrialWorkload
    from canary.targets import embedded_server

    started = time.perf_counter()
    with embedded_server(DEFAULT_MODEL, log_dir=workdir / "servers") as baseline, \
            embedded_server(DEFAULT_MODEL, faults=faults, log_dir=workdir / "servers") as candidate:
        setup = time.perf_counter() - started
        started = time.perf_counter()
        outcome = run_ab(candidate, baseline, DriverOptions(**AB_WORKLOAD, seed=seed), PERF_TOLERANCE,
                         pairs=AB_PAIRS, max_pairs=AB_MAX_PAIRS, progress=False,
                         workload=TrialWorkload(**AB_TRIAL_WORKLOAD))
    return GateResult(outcome.failures, time.perf_counter() - started, setup)


def is_correctness_oracle(line: str) -> bool:
    return line.startswith("[") and not line.startswith(("[perf-regression]", "[perf-inconclusive]"))


def tagged(tag: str):
    return lambda line: line.startswith(tag)


def by_tag(gate: str, run, tag: str, **kw) -> Detector:
    """A gate that fires through one check, whatever the fault: `tag` is its reason and its oracle."""
    return Detector(gate, run, tagged(tag), oracles=(tag.split("]")[0] + "]",), **kw)


# The canary gate fires for any correctness oracle; which ones a fault should trip is per fault
# (`expecting` in DETECTORS): at least one of them must fire, not just any oracle.
CANARY_GATE = Detector(f"canary gate ({CANARY_WORKLOAD['sessions']} sessions x {CANARY_WORKLOAD['turns']} turns)",
                       canary_gate, is_correctness_oracle)
AB_PERF_GATE = by_tag(f"A/B perf gate ({AB_WORKLOAD['sessions']} sessions, {AB_PAIRS}+ trial pairs)", ab_perf_gate,
                      "[perf-regression]", timed=True)
STREAM_EMULATOR = by_tag("CPU stream emulator vs in-order", engine_gates.stream_emulator, "[stream-emulator]")
OVERLAP_VS_NORMAL = by_tag("overlap loop vs normal loop", engine_gates.overlap_vs_normal, "[overlap-vs-normal]")
TP_PLAN_CHECK = by_tag("TP=2 plan check", engine_gates.tp_plan_check, "[tp-plan-check] DesyncError")
GPU_JITTER = by_tag("GPU jittered streams vs in-order", gpu_gates.jitter_vs_in_order, "[jitter-vs-in-order]",
                    needs_gpu=True)
# A generic "[pd-request]" failure is not the gate firing: only its named checks are.
PD_CHECKS = ("[pd-kv-integrity]", "[pd-restart]", "[pd-consistency]", "[pd-kv-leak]")
PD_RESTART_GATE = Detector("PD pair: restarts, prefill loss, leak checks", pd_gates.pd_restart_gate,
                           lambda line: line.startswith(PD_CHECKS), unavailable=pd_gates.unavailable)
GPU_GRAPH_VS_EAGER = by_tag("GPU graph replay vs eager", gpu_gates.graph_vs_eager, "[graph-vs-eager]",
                            needs_gpu=True)

DETECTORS: dict[str, tuple[Detector, ...]] = {
    "stream-race": (STREAM_EMULATOR, GPU_JITTER),
    "stale-graph-metadata": (GPU_GRAPH_VS_EAGER,),
    "kv-slot-reuse": (CANARY_GATE.expecting("[golden]", "[nonce-echo]", "[cross-session-bleed]", "[json-schema]",
                                            "[gibberish]", "[repetition]", "[stream-equivalence]", "[json-parse]",
                                            "[known-function]"),),
    "tp-local-abort": (TP_PLAN_CHECK,),
    "overlap-stale-token": (OVERLAP_VS_NORMAL,),
    "tool-json-corrupt": (CANARY_GATE.expecting("[json-parse]", "[json-schema]", "[stream-equivalence]", "[golden]",
                                                "[nonce-echo]"),),
    "slow-step": (AB_PERF_GATE,),
    # Every token stays (measured: 0 of 57 transcripts diverge at 16 x 2); only the logprob check sees it.
    "abort-leak": (CANARY_GATE.expecting("[kv-leak]"),),
    "stop-string-kept": (CANARY_GATE.expecting("[stop-string]"),),
    "shared-sampling-generator": (CANARY_GATE.expecting("[load-vs-solo]", "[golden]"),),
    "indexer-window-off-by-one": (CANARY_GATE.expecting("[golden-logprob]"),),
    # A turn's prompt starts with its session's earlier turns: their cached pages are copied, one wrongly.
    "prefix-cache-stale-page": (CANARY_GATE.expecting("[golden]", "[golden-logprob]", "[load-vs-solo]"),),
    # runtime/faults.py PD_REGISTRY: a prefill/decode pair, each side restarted in turn.
    "pd-stale-bootstrap": (PD_RESTART_GATE.expecting("[pd-restart]"),),
    "pd-abort-leak": (PD_RESTART_GATE.expecting("[pd-kv-leak]"),),
    "pd-kv-corrupt": (PD_RESTART_GATE.expecting("[pd-kv-integrity]"),),
}
