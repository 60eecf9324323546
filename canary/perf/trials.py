"""Repeated perf trials and their verdict, in the two forms the gate has.

- A/B (`ab_trials`): a baseline server and the candidate, pairs in the order A B, B A, A B ..., each
  pair's decode bursts taken in turns (`trial_load.measure_pair`), so a drift of the machine hits
  both sides alike; one log-ratio per pair, a t interval on their mean.
- Stored (`stored_trials`): the candidate's trials against the trials recorded with the baseline
  (`record_trials`); Welch's interval on the difference of their log costs. On CPU the
  machine-speed probe taken around each trial only guards the comparison: a run whose probe (the
  geometric mean of its trials') is beyond the tolerance of the recording's is inconclusive.
  Why not scale each trial's cost by its probe, as this did until 2026-12-05: on the 2-core host
  the probe read the machine 3-11% faster than at the recording while the server's raw figures had
  not moved, and the scaling charged 3 of 5 clean verdicts as 9-11% "slower"; the same 10
  verdicts compared raw were all right (5 clean ok, 5 slowed caught; docs/results.md, twenty-first
  session). Within one host the probe (one thread, compute) and the trials (server, client and
  their threads) are slowed by different neighbours: the costs followed the probe with slopes of
  0.07-0.47, not 1. Across hosts of other speeds the guard says "not comparable" rather than
  guess.

Interval and verdict: canary/perf/ratio_stats.py. One trial's workload: canary/perf/trial_load.py.
Costs, not speeds: a metric's log cost is -log(tok/s) or +log(TTFT), so > 0 is always "slower",
and cost x machine speed is the same on a faster or slower machine.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from canary.perf import ratio_stats
from canary.perf.ratio_stats import INCONCLUSIVE, MAX_TRIALS_FACTOR, MIN_TRIALS_DEFAULT, OK, SLOWER, RatioVerdict
from canary.perf.trial_load import (
    TrialFigures,
    TrialWorkload,
    higher_is_better,
    measure_pair,
    measure_trial,
    read_recorded,
)
from canary.targets import Target

Measure = Callable[[Target, TrialWorkload, int], TrialFigures]
# Both sides of an A/B pair: (first, second, workload, trial) -> (first's figures, second's figures)
MeasurePair = Callable[[Target, Target, TrialWorkload, int], tuple[TrialFigures, TrialFigures]]
Probe = Callable[[], float]
CHECK_EVERY = 3  # after the minimum, trials are added in steps of this many until the verdict decides


def recorded_trials(min_trials: int) -> int:
    """How many trials a stored baseline records: its noise stays in every later verdict's interval
    (Welch's), however many trials the candidate adds, so it gets three times a verdict's minimum."""
    return max(3 * min_trials, 8)


def log_cost(metric: str, value: float) -> float:
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{metric} = {value}: a trial figure must be a positive number")
    return -math.log(value) if higher_is_better(metric) else math.log(value)


@dataclass
class TrialsOutcome:
    mode: str  # "ab" | "stored"
    status: str  # ratio_stats.OK | SLOWER | INCONCLUSIVE
    verdicts: list[RatioVerdict]
    trials: list[dict] = field(default_factory=list)  # each side's figures (and probe) in run order
    tolerance: float = 0.1
    # Stored form: seconds since the baseline was recorded (None: not known). On a shared CPU host a
    # stored verdict an hour from its recording raised a false alarm where those within 40 minutes
    # raised none (docs/results.md, twenty-first session): an alarm's line says how old its baseline is.
    baseline_age_s: float | None = None

    def failures(self) -> list[str]:
        """Gate failure lines: every metric that is slower or inconclusive, each with its interval."""
        tag = {SLOWER: "[perf-regression]", INCONCLUSIVE: "[perf-inconclusive]"}
        label = "A/B " if self.mode == "ab" else ""
        age = "" if self.baseline_age_s is None else f"; baseline recorded {_age(self.baseline_age_s)} ago"
        return [f"{tag[v.status]} {label}{v.describe()}{age}" for v in self.verdicts if v.status != OK]

    def summary(self) -> dict:
        return {"mode": self.mode, "status": self.status, "tolerance": self.tolerance,
                "verdicts": ratio_stats.verdict_dicts(self.verdicts), "trials": self.trials,
                **({} if self.baseline_age_s is None else {"baseline_age_s": round(self.baseline_age_s)})}


def _age(seconds: float) -> str:
    minutes = max(0, round(seconds / 60))
    if minutes < 120:
        return f"{minutes} min"
    return f"{minutes / 60:.0f} h" if minutes < 72 * 60 else f"{minutes / 1440:.0f} days"


def _baseline_age(stored: dict) -> float | None:
    """Seconds since a stored baseline was recorded; None for one recorded before baselines said when."""
    recorded_at = stored.get("recorded_at")
    return None if recorded_at is None else time.time() - recorded_at


def _decided(verdicts: list[RatioVerdict]) -> bool:
    return ratio_stats.overall(verdicts) != INCONCLUSIVE


def _checkpoints(min_trials: int, max_trials: int) -> list[int]:
    points = list(range(min_trials, max_trials, CHECK_EVERY)) + [max_trials]
    return sorted(set(p for p in points if p >= 2))


def sequential_pair(measure: Measure) -> MeasurePair:
    """A pair from a one-server measure: the first side's whole trial, then the second's."""
    def pair(first: Target, second: Target, workload: TrialWorkload, trial: int):
        return measure(first, workload, trial), measure(second, workload, trial + 1)
    return pair


def ab_trials(candidate: Target, baseline: Target, workload: TrialWorkload, tolerance: float,
              min_pairs: int = MIN_TRIALS_DEFAULT, max_pairs: int = MIN_TRIALS_DEFAULT * MAX_TRIALS_FACTOR,
              run_pair: MeasurePair = measure_pair,
              on_trial: Callable[[dict], None] | None = None) -> TrialsOutcome:
    """Interleaved A/B pairs; more pairs (up to `max_pairs`) only while the verdict is inconclusive.
    `run_pair` measures one pair: by default its bursts alternate between the servers
    (`measure_pair`); `sequential_pair(measure)` runs a one-server measure (e.g. a synthetic one in
    tests) on each side in turn, whole trial after whole trial."""
    if not 2 <= min_pairs <= max_pairs:
        raise ValueError(f"need 2 <= min_pairs <= max_pairs, got {min_pairs}, {max_pairs}")
    sides = {"baseline": baseline, "candidate": candidate}
    run_pair(baseline, candidate, workload, -2)  # warm-up, not counted: first requests pay lazy initialisation
    trials: list[dict] = []
    ratios: dict[str, list[float]] = {m: [] for m in workload.metrics()}
    verdicts: list[RatioVerdict] = []
    pair = 0
    for checkpoint in _checkpoints(min_pairs, max_pairs):
        while pair < checkpoint:
            order = ("baseline", "candidate") if pair % 2 == 0 else ("candidate", "baseline")
            figures = dict(zip(order, run_pair(sides[order[0]], sides[order[1]], workload, 2 * pair)))
            for name in order:
                trials.append({"pair": pair, "side": name, **figures[name].record()})
                if on_trial:
                    on_trial(trials[-1])
            for metric in ratios:
                ratios[metric].append(log_cost(metric, figures["candidate"].figures[metric])
                                      - log_cost(metric, figures["baseline"].figures[metric]))
            pair += 1
        verdicts = [ratio_stats.decide(m, ratio_stats.mean_interval(r, ratio_stats.VERDICT_CONFIDENCE), tolerance)
                    for m, r in ratios.items()]
        if _decided(verdicts):
            break
    return TrialsOutcome("ab", ratio_stats.overall(verdicts), verdicts, trials, tolerance)


def _probed_trial(target: Target, workload: TrialWorkload, index: int, measure: Measure,
                  probe: Probe | None) -> dict:
    """One trial with the machine-speed probe before and after it (geometric mean: the probe moved
    1.9 -> 2.5 ms per block within seconds on one runner); speed None where no probe applies."""
    before = probe() if probe else None
    figures = measure(target, workload, index)
    speed = math.sqrt(before * probe()) if probe and before else None
    return {"trial": index, **figures.record(), "machine_speed": speed}


def log_costs(trials: list[dict], metric: str) -> list[float]:
    return [log_cost(metric, t["figures"][metric]) for t in trials]


def record_trials(target: Target, workload: TrialWorkload, trials: int = 8, measure: Measure = measure_trial,
                  probe: Probe | None = None, on_trial: Callable[[dict], None] | None = None) -> dict:
    """A stored baseline's perf part: the raw trials with their probes (the guard's reference)."""
    measure(target, workload, -1)  # warm-up
    runs = []
    for i in range(trials):
        runs.append(_probed_trial(target, workload, i, measure, probe))
        if on_trial:
            on_trial(runs[-1])
    speeds = [t["machine_speed"] for t in runs if t["machine_speed"]]
    return {"workload": workload.describe(), "trials": runs, "recorded_at": time.time(),
            "machine_speed": statistics.geometric_mean(speeds) if speeds else None}


def stored_trials(target: Target, stored: dict, workload: TrialWorkload, tolerance: float,
                  min_trials: int = MIN_TRIALS_DEFAULT,
                  max_trials: int = MIN_TRIALS_DEFAULT * MAX_TRIALS_FACTOR, measure: Measure = measure_trial,
                  probe: Probe | None = None, not_comparable: str | None = None,
                  on_trial: Callable[[dict], None] | None = None) -> TrialsOutcome:
    """The candidate's trials against a `record_trials` baseline. With a probe, both sides must have
    been probed (a recording without one on a probed machine cannot be compared: inconclusive) and
    read within the tolerance of each other (`ratio_stats.speed_not_comparable`). `not_comparable`:
    why the caller knows the machine is not the recording's (then no trial runs: inconclusive)."""
    if "workload" not in stored or read_recorded(stored["workload"]) != workload:
        raise ValueError(f"stored perf trials ran {stored.get('workload')}, this run {workload.describe()}")
    if not_comparable:
        unjudged = [ratio_stats.decide(m, None, tolerance, not_comparable) for m in workload.metrics()]
        return TrialsOutcome("stored", INCONCLUSIVE, unjudged, [], tolerance, _baseline_age(stored))
    recorded_speed = stored.get("machine_speed")
    measure(target, workload, -1)  # warm-up
    runs: list[dict] = []
    verdicts: list[RatioVerdict] = []
    for checkpoint in _checkpoints(min_trials, max_trials):
        while len(runs) < checkpoint:
            runs.append(_probed_trial(target, workload, len(runs), measure, probe))
            if on_trial:
                on_trial(runs[-1])
        why = None
        if probe is not None:
            why = ("the baseline was recorded without a machine-speed probe" if not recorded_speed else
                   ratio_stats.speed_not_comparable([t["machine_speed"] / recorded_speed for t in runs], tolerance))
        verdicts = [ratio_stats.decide(m, ratio_stats.difference_interval(
            log_costs(runs, m), log_costs(stored["trials"], m), ratio_stats.VERDICT_CONFIDENCE), tolerance, why)
            for m in workload.metrics()]
        if why or _decided(verdicts):
            break
    return TrialsOutcome("stored", ratio_stats.overall(verdicts), verdicts, runs, tolerance, _baseline_age(stored))


def workload_from(record: dict) -> TrialWorkload:
    return read_recorded(record["workload"])
