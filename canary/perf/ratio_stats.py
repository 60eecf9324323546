"""The perf verdict's statistics: a confidence interval on the slowdown ratio of repeated trials,
and the three-way verdict drawn from it ("ok", "slower", "inconclusive").

Why not one p50 of one burst: on the H200 the unchanged build failed a 10% gate 3 times out of 3
that way, and an A/B at 20% failed a clean run 1 time in 3 (docs/results.md, issue 17). Here each
trial gives one log-ratio (candidate against baseline, oriented so that > 0 is slower), and the
verdict reads a Student-t interval on their mean whose bounds are each one-sided at
`ONE_SIDED_ALPHA`, and more trials are taken while it cannot tell (canary/perf/trials.py):

- "slower": the lower bound is above no slowdown (it excludes 0) and the mean is nearer the
  tolerance than 0 (a slowdown of `tolerance` is the one the gate must catch).
- "ok": the upper bound is below the tolerance (it excludes a tolerance-sized slowdown) and the
  mean is nearer 0.
- "inconclusive": anything else - too few trials, an interval that excludes neither, or a machine
  that is not comparable. It fails the gate: a verdict that cannot see a slowdown must not pass one.

Why this rule (2026-12-04): the one before called "ok" or "slower" only once a two-sided 95%
interval was narrower than the tolerance (or lay wholly on one side of its midpoint), i.e. a
half-width under tolerance / 2. At the per-pair noise measured on the 2-core CPU and the H200 (a
log ratio's sd 0.06-0.12) that needs 20-40 pairs, and the verdict stopped at 12: a clean build
was "inconclusive" in 13 of 14 CPU runs and 6 of 15 H200 runs (docs/results.md). Deciding each
side with its own one-sided test needs a half-width under the whole tolerance: about a quarter of
the pairs. Its error rates, three metrics a run, looks every 3 pairs from 6 to 36, simulated on
Gaussian pairs (600 runs a cell; tests/unit/test_perf_verdict.py checks the 0.09 column with two
metrics: 4 alarms in 300 clean runs, 300 of 300 slowed runs caught):

    per-pair sd        0.06    0.09    0.12
    clean: ok          99.5%   99.2%   79%   (the rest inconclusive or, 0.5-1%, slower: mostly
                                              a chance draw at the first looks)
    10% slower: caught 100%    100%    100%
    pairs, mean        10      15      21

Since 2026-12-05 the cap is 72 pairs (canary/perf/trials.py `MAX_TRIALS_FACTOR`): one clean H200
verdict of 11 read a pair's sd of 0.114 and ended inconclusive at 36. The same simulation, two metrics,
600 runs a cell, cap 36 -> 72: clean ok 99.3 -> 99.3% / 98.8 -> 99.0% / 84.8 -> 98.8% at sd 0.06 /
0.09 / 0.12 (inconclusive 14.2% -> 0 at 0.12; "slower" stays 0.7-1.2%, the early looks' draws), 10%
slower caught 99.5-100%.

Pure arithmetic on floats (no scipy on the device image): the t quantile comes from integrating the
density, which is plenty exact for a verdict.
"""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass

# The most trials a verdict takes, as a multiple of its minimum (6 -> 72). At the noise measured on
# the CPU and the H200 a verdict needs 10-21 pairs on average (the table above), but
# the noise of one verdict's pairs varies: on the H200 (2026-12-05, 11 clean A/B verdicts) a pair's
# decode@8 log-ratio sd ranged 0.04-0.125. Simulated (tests/unit/test_perf_verdict.py), at sd 0.114 a
# cap of 36 pairs left 9% of clean verdicts inconclusive, 72 none; the bounds' alpha is unchanged, so
# more pairs only let a noisy run decide, at the cost of time in those runs alone.
MAX_TRIALS_FACTOR = 12
# Trials (A/B: pairs) before a verdict's first look, unless the caller says otherwise (`--perf-trials`).
MIN_TRIALS_DEFAULT = 6

OK, SLOWER, INCONCLUSIVE = "ok", "slower", "inconclusive"
# Each bound of a verdict's interval: a clean metric is called slower, or a tolerance-sized slowdown
# ok, with at most this probability at one look (looks every few trials add to it: the table above).
ONE_SIDED_ALPHA = 0.001
VERDICT_CONFIDENCE = 1 - 2 * ONE_SIDED_ALPHA  # the two-sided interval whose bounds are those
MIN_TRIALS = 3


def t_cdf(x: float, df: int) -> float:
    """P(T <= x) for Student's t with `df` degrees of freedom (Simpson's rule on the density)."""
    if df < 1:
        raise ValueError(f"t distribution needs df >= 1, got {df}")
    log_norm = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)

    def density(t: float) -> float:
        return math.exp(log_norm - (df + 1) / 2 * math.log1p(t * t / df))

    a = abs(x)
    steps = 1000  # even; the density is smooth: error below 1e-6 for the quantiles a verdict uses
    h = a / steps
    area = density(0) + density(a) + sum((4 if i % 2 else 2) * density(i * h) for i in range(1, steps))
    half = area * h / 3
    return 0.5 + half if x >= 0 else 0.5 - half


@functools.lru_cache(maxsize=256)  # a verdict asks for a handful of (p, df) pairs, many times
def t_quantile(p: float, df: int) -> float:
    """The x with t_cdf(x, df) = p, by bisection (p in (0.5, 1))."""
    if not 0.5 < p < 1:
        raise ValueError(f"quantile wanted for p in (0.5, 1), got {p}")
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
    return (lo + hi) / 2


@dataclass(frozen=True)
class Interval:
    """A two-sided interval on the mean log slowdown (log(candidate cost / baseline cost))."""

    mean: float
    low: float
    high: float
    n: int

    @property
    def width(self) -> float:
        return self.high - self.low


def mean_interval(log_ratios: Sequence[float], confidence: float = 0.95) -> Interval:
    """One-sample t interval (paired A/B trials: one log-ratio per pair)."""
    n = len(log_ratios)
    if n < 2:
        raise ValueError(f"an interval needs at least two trials, got {n}")
    mean = sum(log_ratios) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in log_ratios) / (n - 1))
    half = t_quantile(0.5 + confidence / 2, n - 1) * sd / math.sqrt(n)
    return Interval(mean, mean - half, mean + half, n)


def difference_interval(candidate: Sequence[float], baseline: Sequence[float],
                        confidence: float = 0.95) -> Interval:
    """Welch's interval on mean(candidate) - mean(baseline) (log costs of unpaired trials: a stored
    baseline's recorded trials against this run's), so the baseline's own noise is counted too."""
    nc, nb = len(candidate), len(baseline)
    if nc < 2 or nb < 2:
        raise ValueError(f"an interval needs at least two trials a side, got {nc} and {nb}")
    mc, mb = sum(candidate) / nc, sum(baseline) / nb
    vc = sum((x - mc) ** 2 for x in candidate) / (nc - 1) / nc
    vb = sum((x - mb) ** 2 for x in baseline) / (nb - 1) / nb
    se = math.sqrt(vc + vb)
    if se == 0:
        return Interval(mc - mb, mc - mb, mc - mb, nc)
    df = (vc + vb) ** 2 / (vc ** 2 / (nc - 1) + vb ** 2 / (nb - 1))  # Welch-Satterthwaite
    half = t_quantile(0.5 + confidence / 2, max(1, math.floor(df))) * se
    return Interval(mc - mb, mc - mb - half, mc - mb + half, nc)


@dataclass(frozen=True)
class RatioVerdict:
    """One metric's verdict. Ratios are candidate cost / baseline cost (1.1 = 10% slower)."""

    metric: str
    status: str  # OK | SLOWER | INCONCLUSIVE
    ratio: float  # point estimate
    low: float  # the interval's bounds, as ratios
    high: float
    trials: int
    tolerance: float
    reason: str

    def describe(self) -> str:
        if not self.trials:
            return f"{self.metric}: no trials, tolerance {self.tolerance * 100:.0f}%: {self.status} ({self.reason})"
        return (f"{self.metric}: {(self.ratio - 1) * 100:+.1f}% slower "
                f"[{(self.low - 1) * 100:+.1f}%, {(self.high - 1) * 100:+.1f}%], {self.trials} trials, "
                f"tolerance {self.tolerance * 100:.0f}%: {self.status} ({self.reason})")


def decide(metric: str, interval: Interval | None, tolerance: float, not_comparable: str | None = None) -> RatioVerdict:
    """The three-way verdict on one metric's interval (module docstring), computed at
    `VERDICT_CONFIDENCE`; `not_comparable` says why the machine is not the baseline's (then the
    verdict is inconclusive whatever the interval)."""
    if not tolerance > 0:
        raise ValueError(f"tolerance must be positive, got {tolerance}")
    if interval is None:
        return RatioVerdict(metric, INCONCLUSIVE, math.nan, math.nan, math.nan, 0, tolerance,
                            not_comparable or "no trials")
    ratio, low, high = math.exp(interval.mean), math.exp(interval.low), math.exp(interval.high)
    limit = math.log1p(tolerance)
    nearer_tolerance = interval.mean >= limit / 2  # the midpoint in log space

    def verdict(status: str, reason: str) -> RatioVerdict:
        return RatioVerdict(metric, status, ratio, low, high, interval.n, tolerance, reason)

    if not_comparable:
        return verdict(INCONCLUSIVE, not_comparable)
    if interval.n < MIN_TRIALS:
        return verdict(INCONCLUSIVE, f"{interval.n} trials, at least {MIN_TRIALS} needed")
    if interval.low > 0 and nearer_tolerance:
        return verdict(SLOWER, "interval excludes no slowdown")
    if interval.high < limit and not nearer_tolerance:
        return verdict(OK, "interval excludes a tolerance-sized slowdown")
    return verdict(INCONCLUSIVE, f"interval ({(low - 1) * 100:+.1f}%, {(high - 1) * 100:+.1f}%) excludes neither no "
                                 "slowdown nor a tolerance-sized one: too noisy to tell them apart")


def overall(verdicts: Sequence[RatioVerdict]) -> str:
    """The run's verdict: slower if any metric is, else inconclusive if any is (or none ran), else ok."""
    statuses = {v.status for v in verdicts}
    if SLOWER in statuses:
        return SLOWER
    if INCONCLUSIVE in statuses or not verdicts:
        return INCONCLUSIVE
    return OK


def speed_not_comparable(probe_ratios: Sequence[float], tolerance: float) -> str | None:
    """Why this machine is not the one a stored baseline was recorded on, or None. The machine's
    speed now against the recording's is the geometric mean of the trials' probe ratios (a single
    trial's probe is noisy: 0.73-1.18 within one clean run on the 2-core host); it must be within
    the tolerance either way. Beyond it a raw comparison cannot tell the machine's change from the
    build's, and scaling by the probe was measured to be worse (canary/perf/trials.py)."""
    if not probe_ratios or not all(math.isfinite(r) and r > 0 for r in probe_ratios):
        return "machine not comparable: a speed probe failed or read nothing"
    ratio = statistics.geometric_mean(probe_ratios)
    if abs(math.log(ratio)) <= math.log1p(tolerance):
        return None
    return (f"machine not comparable: speed probe {ratio:.2f}x the recording machine's, beyond the "
            f"{tolerance * 100:.0f}% tolerance: record the baseline again on this machine, or compare A/B "
            "(--baseline-url)")


def verdict_dicts(verdicts: Sequence[RatioVerdict]) -> list[dict]:
    return [asdict(v) for v in verdicts]
