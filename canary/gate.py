"""The canary gate: drive the sessions, apply every oracle, check golden transcripts and leaks,
gate performance, write the report. Returns a `GateOutcome`; the pytest plugin turns it into a
pass/fail with a message that names each oracle that fired. `run_configured` is what the stress
test runs: the choice between A/B, gate and sweep, and the report writing, from `CanaryOptions`."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from canary import calibration
from canary.driver import DriverOptions, RequestRecord, RunResult
from canary.driver_pool import run_sessions
from canary.options import CanaryOptions
from canary.oracles import differential
from canary.oracles.golden import LOGPROB_ATOL, Transcript, first_divergence, logprob_drift, read_store, write_store
from canary.perf import machine_speed
from canary.perf import trials as perf_trials
from canary.perf import verdict as perf
from canary.perf.metrics import run_metrics
from canary.perf.trial_load import TrialWorkload
from canary.provenance import device_name, fingerprint, git_commit, gpu_identity, versions
from canary.targets import Target

GOLDEN_DIR = Path("golden/transcripts")
PERF_WORKLOAD = TrialWorkload()  # the perf verdict's trial workload (canary/perf/trial_load.py)
PREEMPTIONS = "dsv4_preemptions_total"  # the runtime's counter (runtime/server/metrics.py)
# The runtime's prefix-cache counters (runtime/server/metrics.py): prefill tokens served from the cache, of all.
PREFIX_TOKENS = ("dsv4_prefix_cache_hit_tokens_total", "dsv4_prefix_cache_lookup_tokens_total")
# The runtime's step-time histogram's sum and count (runtime/server/metrics.py).
STEP_SECONDS = ("dsv4_engine_step_seconds_sum", "dsv4_engine_step_seconds_count")
BASELINE_DIR = Path("golden/baselines")


@dataclass
class GateOutcome:
    failures: list[str] = field(default_factory=list)  # each names the oracle that fired
    notes: list[str] = field(default_factory=list)  # loud, non-failing messages (skipped oracles, no baseline)
    summary: dict = field(default_factory=dict)
    report: Path | None = None  # summary.json under --report-dir, once written

    @property
    def passed(self) -> bool:
        return not self.failures


def run_driver(target: Target, options: DriverOptions, progress: bool = True,
               on_request_done: Callable[[RequestRecord], None] | None = None) -> RunResult:
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(desc=f"canary {target.name}", unit="req", leave=False, dynamic_ncols=True)
    tokens = [0]

    def done(record) -> None:
        tokens[0] += record.completion_tokens
        if bar is not None:
            bar.update(1)
            elapsed = bar.format_dict.get("elapsed") or 1e-9
            bar.set_postfix(tok_s=f"{tokens[0] / elapsed:.0f}", refresh=False)
        if on_request_done is not None:
            on_request_done(record)

    try:
        return run_sessions(target, options, on_request_done=done)
    finally:
        if bar is not None:
            bar.close()


# GPU kinds (and dtypes) whose gate transcripts were found byte-identical to another kind's store: a
# kind with no store of its own is checked against that one, and a recording still writes its own.
# H100 SXM, float32: all 581 requests of the 80-session gate, recorded on an H100 at d1a87e7 (the merge
# as a dependent launch on), equal the H200 store recorded at 280c230 (docs/results.md, "Thirty-ninth
# session"): the same sm_90 kernels, whose bits do not follow the launch. bfloat16 was not compared.
SAME_NUMERICS_AS: dict[tuple[str, str], str] = {("nvidia-h100-80gb-hbm3", "float32"): "nvidia-h200"}


def golden_path(target: Target, info: dict, own: bool = False) -> Path:
    """Golden tokens are per numerics: the CPU float32 store (what CI checks) or one per GPU model
    and dtype (its kernels reduce in other orders, so an indexer or logit near-tie may resolve
    differently; a GPU is checked against transcripts recorded on its own kind, or on a kind shown to
    give the same ones, SAME_NUMERICS_AS, while it has none). `own`: this kind's path whatever exists
    (what a recording writes)."""
    model = Path(str(info.get("model") or target.model)).name
    engine = info.get("engine_config") or {}
    device, dtype = engine.get("device", "cpu"), engine.get("dtype", "float32")
    kernels = "".join(f"-{name}-triton" for name in kernel_choices(engine))
    if device == "cpu" and dtype == "float32":
        return GOLDEN_DIR / f"stress-{model}{kernels}.jsonl"
    kind = re.sub(r"[^a-z0-9]+", "-", str(info.get("device_name") or device).lower()).strip("-")
    path = GOLDEN_DIR / f"stress-{model}.{kind}-{dtype}{kernels}.jsonl"
    same = SAME_NUMERICS_AS.get((kind, dtype))
    if own or same is None or path.is_file():
        return path
    borrowed = GOLDEN_DIR / f"stress-{model}.{same}-{dtype}{kernels}.jsonl"
    return borrowed if borrowed.is_file() else path


def kernel_choices(engine: dict) -> list[str]:
    """The kernels a server runs in place of the default torch ones ("moe", "attention"): each is
    another numerics and another speed, so it names its own golden store and perf baseline."""
    return [name for name in ("moe", "attention") if engine.get(f"{name}_kernel", "torch") != "torch"]


def check_golden(result: RunResult, path: Path, update: bool, metadata: dict, outcome: GateOutcome,
                 near_tie: float, logprob_atol: float | None = None) -> None:
    """Tokens, then (where the store recorded a `logprob_atol`) each matched token's logprob within
    it. `logprob_atol`: what a store written now records (golden.LOGPROB_ATOL of the run's dtype)."""
    transcripts = result.transcripts
    if update and outcome.failures:  # a failed run's tokens are no one's golden transcripts
        outcome.notes.append(f"golden transcripts NOT updated at {path}: the run failed")
        return
    if update:
        merged: dict[str, Transcript] = {}
        if path.is_file():
            merged.update(read_store(path)[1])
        merged.update({t.scenario: t for t in transcripts})
        recorded = {**metadata, **({"logprob_atol": logprob_atol} if logprob_atol is not None else {})}
        write_store(path, recorded, [merged[k] for k in sorted(merged)])
        outcome.notes.append(f"golden transcripts updated: {path} ({len(merged)} requests)")
        return
    if not path.is_file():
        outcome.notes.append(f"NO GOLDEN TRANSCRIPTS at {path}: golden oracle skipped; record with --golden-update")
        return
    meta, golden = read_store(path)
    if meta.get("model_hash") and metadata.get("model_hash") and meta["model_hash"] != metadata["model_hash"]:
        outcome.failures.append(f"[golden] model hash {metadata['model_hash']} differs from the golden "
                                f"transcripts' {meta['model_hash']} ({path})")
        return
    atol = meta.get("logprob_atol")
    if atol is None:
        outcome.notes.append(f"golden store {path} records no logprobs (written before they were kept): golden "
                             "oracle compares tokens only; re-record it with --golden-update")
    diverged_sessions: set[str] = set()
    checked = benign = logprobs_checked = 0
    for t in sorted(transcripts, key=_request_order):
        session = t.scenario.rsplit("-req-", 1)[0]
        if session in diverged_sessions or t.scenario not in golden:
            continue
        checked += 1
        div = first_divergence(golden[t.scenario], t, near_tie)
        if atol is not None:  # up to the first divergence: after it the contexts differ
            drift = logprob_drift(golden[t.scenario], t, atol, upto=None if div is None else div.position)
            logprobs_checked += bool(golden[t.scenario].logprobs and t.logprobs)
            if drift is not None:
                outcome.failures.append(f"[golden-logprob] {drift.describe()}")
        if div is None:
            continue
        diverged_sessions.add(session)  # later requests of this session are no longer comparable
        if div.benign:
            benign += 1
        else:
            outcome.failures.append(f"[golden] {div.describe()}")
    outcome.summary["golden"] = {"path": str(path), "checked": checked, "benign_near_ties": benign,
                                 "golden_commit": meta.get("commit"), "logprob_atol": atol,
                                 "logprobs_checked": logprobs_checked}


def _request_order(t: Transcript) -> tuple[str, int, str]:
    """`session-S-req-N` in request order; a probe (`req-N.stop`, canary/workload.py) after its request."""
    session, _, rest = t.scenario.rpartition("-req-")
    hop, _, probe = rest.partition(".")
    return session, int(hop), probe


def trials_fingerprint(target: Target, info: dict, workload: TrialWorkload) -> dict:
    """What a perf baseline is valid for: hardware, model, config, kernels and the trial workload
    (not the gate's sessions: the verdict measures its own fixed workload, canary/perf/trial_load.py)."""
    fp = {"hardware": device_name(), "model": info.get("model", target.model), "model_hash": info.get("model_hash"),
          "config_fingerprint": info.get("config_fingerprint"), "perf": "trials-v1", "workload": workload.describe()}
    engine = info.get("engine_config") or {}
    kernels = kernel_choices(engine)
    if kernels:
        fp["triton_kernels"] = kernels
    # Another dtype is another speed (and another golden store, golden_path): keyed like the kernels,
    # only off the default, so the baselines recorded before the key existed keep their names.
    if engine.get("dtype", "float32") != "float32":
        fp["dtype"] = engine["dtype"]
    # Likewise a server with the prefix cache on, and a PD pair (the router answers with its decode
    # server's info): each is another speed, never judged against a colocated baseline without the
    # cache (on the H200 a PD pair read "+86% TTFT, slower" against one). A PD key does not say
    # whether the pair's prefill server caches: the decode side's info cannot.
    if info.get("prefix_cache"):
        fp["prefix_cache"] = True
    if info.get("disaggregation"):
        fp["serving"] = "pd"
    return fp


def gate_perf(target: Target, info: dict, baseline: Path | None, tolerance: float, record: bool,
              outcome: GateOutcome, min_trials: int, workload: TrialWorkload = PERF_WORKLOAD) -> None:
    """The perf verdict against the stored baseline's trials (canary/perf/trials.py `stored_trials`):
    ok passes; slower and inconclusive both fail. `record`: run the trials and store them instead."""
    if min_trials <= 0:
        outcome.notes.append("perf gate off (--perf-trials 0)")
        return
    fp = trials_fingerprint(target, info, workload)
    path = baseline or BASELINE_DIR / f"{fingerprint(fp)}.json"
    probe = machine_speed.probe if probes_this_machine(target) else None
    if record:
        recorded = perf_trials.record_trials(target, workload, perf_trials.recorded_trials(min_trials),
                                             perf_trials.measure_trial, probe)
        if target.embedded:
            recorded["gpu"] = gpu_identity()
        perf.save_trials_baseline(path, fp, recorded)
        outcome.notes.append(f"performance baseline recorded: {path} ({len(recorded['trials'])} trials)")
        return
    stored = perf.load_baseline(path)
    if stored is None or "trials" not in stored:
        what = "NO PERFORMANCE BASELINE" if stored is None else "OLD-FORMAT PERFORMANCE BASELINE (one burst, no trials)"
        outcome.notes.append(f"{what} for this hardware/model/config at {path}: perf gate skipped; "
                             "record one with --baseline-update")
        return
    result = perf_trials.stored_trials(target, stored, workload, tolerance, min_trials=min_trials,
                                       max_trials=perf_trials.MAX_TRIALS_FACTOR * min_trials,
                                       measure=perf_trials.measure_trial, probe=probe,
                                       not_comparable=recorded_elsewhere(target, stored))
    outcome.summary["perf_gate"] = {"baseline": str(path), **result.summary()}
    outcome.failures += result.failures()


def recorded_elsewhere(target: Target, stored: dict) -> str | None:
    """Why a stored baseline cannot judge the embedded server on this GPU: it was recorded on another
    GPU (`gpu_identity`: name and UUID, so another host), or before baselines named theirs. Measured
    on the H200 (sixth session, issue 17): across machine starts the stored verdict read +22% and
    +36% "slower" for a build an A/B on one machine found 4.8% faster, and an unchanged build failed
    3 of 3 - the canary's trials are host-bound, and hosts differ. On a CPU the speed probe guards
    instead (`stored_trials`); an external server's machine is not ours to name (None)."""
    here = gpu_identity() if target.embedded else None
    there = stored.get("gpu")
    if here is None or there == here:
        return None
    recorded_on = there or "(not named: recorded before baselines named theirs)"
    return (f"machine not comparable: the baseline was recorded on GPU {recorded_on}, this run is on GPU {here}: "
            "record the baseline on this machine (--baseline-update) or compare A/B (--baseline-url)")


def probes_this_machine(target: Target) -> bool:
    """The machine-speed probe says something about the server only when it computes on our CPU.
    Not on a GPU host, measured on the H200 (docs/results.md, sixth session): the probe moved
    232-350 blocks/s from trial to trial with no relation to the canary's host-bound trials, so
    normalizing by it widened the same-machine verdict's intervals to +-20% (inconclusive). There a
    baseline is valid on the GPU it was recorded on only (`recorded_elsewhere`); compare builds on one
    GPU by A/B (`--baseline-url`, scripts/gpu_suite.sh `gate_ab_tree`)."""
    return target.embedded and device_name().startswith("cpu:")


def engine_steps(read: dict[str, float | None]) -> tuple[float, float] | None:
    """(seconds, steps) the runtime's engine has spent in steps so far, from a read of /metrics
    (`Target.metrics` with STEP_SECONDS among the names); None for a server without the histogram."""
    seconds, steps = (read[name] for name in STEP_SECONDS)
    return None if seconds is None or steps is None else (seconds, steps)


def engine_steps_during(before, after, wall_s: float) -> dict | None:
    """The load phase's engine steps: how many, their mean, and the share of the run they filled
    (near 1: the engine loop is the bottleneck; well below: the requests' path around it is)."""
    if before is None or after is None or wall_s <= 0:
        return None
    seconds, steps = after[0] - before[0], after[1] - before[1]
    return {"steps": steps, "seconds": seconds, "mean_ms": 1000 * seconds / steps if steps else 0.0,
            "busy": seconds / wall_s}


def _solo_first(target: Target, options: DriverOptions, calibrate: bool,
                progress: bool) -> tuple[DriverOptions, RunResult | None]:
    """`calibrate`: every session alone first (canary/calibration.py), and the load run's options,
    which then go on past a failed turn as the solo run's do; else the options unchanged, no solo run."""
    if not calibrate:
        return options, None
    options = dataclasses.replace(options, keep_going=True)
    return options, run_driver(target, calibration.solo_options(options), progress)


def run_gate(target: Target, options: DriverOptions, *, golden_update: bool = False, baseline_update: bool = False,
             baseline: Path | None = None,
             perf_tolerance: float = 0.1, near_tie: float = 0.05, progress: bool = True,
             on_request_done: Callable[[RequestRecord], None] | None = None,
             differential_sample: int = differential.DEFAULT_SAMPLE, deterministic: bool | None = None,
             perf_trials_min: int = perf_trials.MIN_TRIALS_DEFAULT, perf_gate: bool = True, calibrate: bool = False,
             perf_workload: TrialWorkload = PERF_WORKLOAD) -> GateOutcome:
    """`deterministic`: the load-vs-solo oracle in exact mode; None = exact for the embedded runtime
    (batch-invariant by construction, so a near-tie flipped by load is its bug), near-ties benign elsewhere.
    `perf_gate` False: no baseline compared or recorded (the small-pool run, canary/workload.py).
    `calibrate`: every session runs alone first; under load only what passed alone counts as
    corruption, and each load request is compared with its solo counterpart (canary/calibration.py)."""
    outcome = GateOutcome()
    info = target.server_info()
    exact = target.embedded if deterministic is None else deterministic
    options, solo = _solo_first(target, options, calibrate, progress)
    before = target.metrics(PREEMPTIONS, *STEP_SECONDS, *PREFIX_TOKENS)
    result = run_driver(target, options, progress, on_request_done)
    outcome.summary["engine_steps"] = engine_steps_during(engine_steps(before),
                                                          engine_steps(target.metrics(*STEP_SECONDS)), result.wall_s)
    if solo is None:
        outcome.failures += [f.describe() for _, f in result.failures]
    else:
        calibration.apply(solo, result, outcome, near_tie=None if exact else near_tie)
    check_session_ends(result, outcome)
    compared_alone = None if solo is None else calibration.has_counterpart(solo)
    differential.check_load_vs_solo(target, result, outcome, sample=differential_sample, near_tie=near_tie,
                                    exact=exact, compared_alone=compared_alone)
    metrics = run_metrics(result)
    metadata = {"commit": git_commit(), "target": target.name, "model": info.get("model", target.model),
                "model_hash": info.get("model_hash"), "config_fingerprint": info.get("config_fingerprint"),
                "device": device_name(), **versions()}
    if target.embedded:
        dtype = (info.get("engine_config") or {}).get("dtype", "float32")
        path = golden_path(target, info, own=golden_update)
        if path != golden_path(target, info, own=True):
            outcome.notes.append(f"golden: this GPU has no store of its own; checked against {path.name}, recorded "
                                 "on a GPU found to give the same tokens (canary.gate.SAME_NUMERICS_AS)")
        check_golden(result, path, golden_update, metadata, outcome, near_tie, LOGPROB_ATOL.get(dtype))
    else:
        outcome.notes.append("golden-transcript oracle skipped: the target is not the embedded canary runtime "
                             "(only a deterministic canary model has golden transcripts)")
    # Any server that exports the gauge gets the leak check (a staging deployment of this runtime,
    # or a proxy in front of one); one without it gets a note saying the check did not run.
    _check_pages_idle(target, outcome)
    after = target.metrics(PREEMPTIONS, *PREFIX_TOKENS)
    def grew(name: str) -> float | None:
        start, end = before[name], after[name]
        return None if start is None or end is None else end - start

    during = {name: grew(name) for name in after}
    outcome.summary["preemptions"] = during[PREEMPTIONS]
    if during[PREFIX_TOKENS[1]] is not None:  # a server with the prefix cache's counters
        outcome.summary["prefix_cache"] = {"hit_tokens": during[PREFIX_TOKENS[0]],
                                           "lookup_tokens": during[PREFIX_TOKENS[1]]}
    if not perf_gate:
        outcome.notes.append(f"perf not gated for {target.name}: its workload is not the baseline's")
        outcome.summary.update(_run_facts(target, options, result, metadata, metrics, outcome))
        return outcome
    record = golden_update or baseline_update
    if record and outcome.failures:
        record = False  # a run that failed an oracle is no one's performance baseline
        outcome.notes.append("performance baseline NOT recorded: the run failed")
    gate_perf(target, info, baseline, perf_tolerance, record, outcome, perf_trials_min, perf_workload)
    outcome.summary.update(_run_facts(target, options, result, metadata, metrics, outcome))
    return outcome


def _run_facts(target: Target, options: DriverOptions, result: RunResult, metadata: dict, metrics: dict,
               outcome: GateOutcome) -> dict:
    return {"target": target.name, "metadata": metadata, "metrics": metrics,
            "sessions_completed": result.sessions_completed,
            "sessions_aborted": result.sessions_aborted,
            "sessions": options.sessions, "oracle_checks": dict(sorted(result.oracle_checks.items())),
            "session_ends": [{"session": i, "status": st, "reason": why}
                             for i, st, why in sorted(result.session_ends) if st != "completed"],
            "failures": [{"t": t, **f.__dict__} for t, f in result.failures],
            "gate_failures": outcome.failures, "notes": outcome.notes}


def check_session_ends(result: RunResult, outcome: GateOutcome) -> None:
    """Every session ended exactly once, as completed, failed or aborted with its reason, and each
    failed session's failure is among the run's failures: a session that stopped early with its
    finding kept to itself would otherwise pass as a smaller run."""
    ends: dict[int, list[tuple[str, str]]] = {}
    for session, status, reason in result.session_ends:
        ends.setdefault(session, []).append((status, reason))
    failed_sessions = {f.session for _, f in result.failures}
    for session in range(result.options.sessions):
        got = ends.get(session, [])
        if len(got) != 1:
            outcome.failures.append(f"[session-accounting] session {session} ended {len(got)} times: {got}")
        elif got[0][0] == "failed" and session not in failed_sessions:
            outcome.failures.append(f"[session-accounting] session {session} ended failed ({got[0][1]}) but no "
                                    "failure of it reached the verdict")
        elif got[0][0] not in ("completed", "failed", "aborted"):
            outcome.failures.append(f"[session-accounting] session {session} ended {got[0][0]!r}: {got[0][1]}")
    outcome.summary["sessions_failed"] = sum(1 for s in ends.values() if s and s[0][0] == "failed")


def _check_pages_idle(target: Target, outcome: GateOutcome) -> None:
    """Every request finished or was aborted: the KV pool must be back at its idle level."""
    pages = target.wait_kv_pages_idle()
    outcome.summary["kv_pages_in_use"] = pages
    if pages is None:
        outcome.notes.append("KV page gauge not found in /metrics: leak oracle skipped")
    elif pages != 0:
        outcome.failures.append(f"[kv-leak] {pages:.0f} KV pages still in use after every session ended")


def run_ab(candidate: Target, baseline_target: Target, options: DriverOptions, tolerance: float, pairs: int = 6,
           progress: bool = True, workload: TrialWorkload = PERF_WORKLOAD, max_pairs: int | None = None,
           calibrate: bool = False, near_tie: float = 0.05) -> GateOutcome:
    """The candidate's sessions once through every oracle, then the perf verdict on interleaved
    trials of both servers (canary/perf/trials.py `ab_trials`): slower and inconclusive both fail.
    `pairs` before the first look, up to `max_pairs` (default `MAX_TRIALS_FACTOR` times that) while it
    is inconclusive.
    `calibrate`: the sessions run alone first, as in `run_gate` (a model this project did not train
    fails its task oracles alone too: model quality, not a reason to fail an A/B)."""
    outcome = GateOutcome()
    options, solo = _solo_first(candidate, options, calibrate, progress)
    result = run_driver(candidate, options, progress)
    if solo is None:
        outcome.failures += [f"candidate: {f.describe()}" for _, f in result.failures]
    else:  # near-ties benign, as run_gate has them, except for the embedded runtime (batch-invariant)
        calibrated = GateOutcome()
        calibration.apply(solo, result, calibrated, near_tie=None if candidate.embedded else near_tie)
        outcome.failures += [f"candidate: {line}" for line in calibrated.failures]
        outcome.notes += calibrated.notes
        outcome.summary.update(calibrated.summary)
    if pairs <= 0:
        outcome.notes.append("perf gate off (--perf-trials 0)")
        outcome.summary.update({"target": candidate.name, "gate_failures": outcome.failures})
        return outcome
    verdict = perf_trials.ab_trials(candidate, baseline_target, workload, tolerance, min_pairs=pairs,
                                    max_pairs=max_pairs or perf_trials.MAX_TRIALS_FACTOR * pairs)
    outcome.failures += verdict.failures()
    outcome.summary.update({"ab": {"baseline": baseline_target.name, "candidate": candidate.name,
                                   "workload": workload.describe(), **verdict.summary()},
                            "gate_failures": outcome.failures})
    return outcome


def graph_buckets(info: dict) -> tuple[int, ...]:
    """The CUDA-graph batch buckets of a GPU server of this runtime (where padding cliffs live);
    none on CPU or for a server that does not say its engine config."""
    engine = info.get("engine_config") or {}
    if engine.get("device", "cpu") == "cpu":
        return ()
    from runtime.env import Env
    from runtime.graph.runner import FINE_BUCKETS

    return Env.load().graph_buckets or FINE_BUCKETS


def sweep(target: Target, options: DriverOptions, progress: bool = True) -> dict:
    """Concurrency levels 1, 2, 4, ... up to `options.sessions` and each side of every graph bucket;
    fit step = a + b*bs; flag cliffs."""
    levels = perf.sweep_levels(options.sessions, graph_buckets(target.server_info()))
    rows = []
    for level in levels:
        result = run_driver(target, DriverOptions(**{**options.__dict__, "sessions": level, "concurrency": level,
                                                      "abort_ratio": 0.0, "stream_ratio": 1.0}), progress)
        m = run_metrics(result)
        rows.append({"concurrency": level, "output_tok_s": m["output_tok_s"], "tpot_s": m["tpot_s"],
                     "ttft_s": m["ttft_s"], "failures": len(result.failures)})
    points = [(r["concurrency"], r["tpot_s"]["p50"]) for r in rows if r["tpot_s"]["count"]]
    out: dict[str, Any] = {"sweep": rows, "cliffs": perf.find_cliffs([r["concurrency"] for r in rows],
                                                     [r["output_tok_s"] for r in rows])}
    if len(points) >= 2:
        fit = perf.fit_step_time([p[0] for p in points], [p[1] for p in points])
        out["step_fit"] = {"a": fit.a, "b": fit.b, "r2": fit.r2, "points": points}
    return out


# ---- what `pytest -m stress` runs -----------------------------------------------------------------
def perf_workload(options: CanaryOptions) -> TrialWorkload:
    """The perf verdict's trial workload: PERF_WORKLOAD, with what `--perf-workload` changes (a server
    this project did not write may be too slow for its 8-request bursts of 48 tokens, or compute
    logprobs slowly: '{"concurrency": [1], "max_tokens": 16, "logprobs": false}')."""
    if not options.perf_workload:
        return PERF_WORKLOAD
    return TrialWorkload.from_dict({**PERF_WORKLOAD.describe(), **options.perf_workload})


def run_configured(options: CanaryOptions, target: Target) -> GateOutcome:
    """The main job as the command line asks for it: the A/B gate against `--baseline-url`, else
    the gate (golden and baseline recorded on `--golden-update`/`--baseline-update`); then the
    concurrency sweep on `--sweep`, and summary.json + plots into `--report-dir`."""
    from canary.options import driver_options

    driver = driver_options(options, target)
    # default: a model this project did not train (plain-words prompts) is calibrated
    calibrate = driver.generic_prompts if options.calibrate is None else options.calibrate
    workload = perf_workload(options)
    if options.baseline_url:
        from canary.targets import remote_target

        baseline = remote_target(options.baseline_url, options.model, options.api_key)
        outcome = run_ab(target, baseline, driver, options.perf_tolerance, pairs=options.perf_trials,
                         workload=workload, calibrate=calibrate)
    else:
        outcome = run_gate(target, driver, golden_update=options.golden_update,
                           baseline_update=options.baseline_update,
                           baseline=options.baseline, perf_tolerance=options.perf_tolerance,
                           differential_sample=options.differential_sample, deterministic=options.deterministic,
                           perf_trials_min=options.perf_trials, calibrate=calibrate, perf_workload=workload)
    if options.sweep:
        outcome.summary.update(sweep(target, driver))
    if options.report_dir:
        from canary.reports import write_plots, write_summary

        outcome.report = write_summary(options.report_dir, outcome.summary)
        write_plots(options.report_dir, outcome.summary)
    return outcome

