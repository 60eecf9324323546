"""bench.perf_noise's pair count agrees with the verdict rule it predicts (canary/perf/ratio_stats.py)."""

from __future__ import annotations

import math

import pytest

from bench.perf_noise import NO_DECISION, noise, pairs_needed
from canary.perf import ratio_stats

pytestmark = pytest.mark.unit


def pairs_with_sd(n: int, sd: float) -> list[float]:
    """n log ratios of mean 0 and sample sd exactly `sd`."""
    raw = [(-1) ** i * (1 + i % 3) for i in range(n)]
    mean = sum(raw) / n
    spread = math.sqrt(sum((x - mean) ** 2 for x in raw) / (n - 1))
    return [(x - mean) * sd / spread for x in raw]


@pytest.mark.parametrize("sd", [0.03, 0.06, 0.09, 0.12, 0.2])
def test_needed_is_the_first_pair_count_at_which_a_clean_verdict_is_ok(sd):
    needed = pairs_needed(sd, 0.1)
    decide = lambda n: ratio_stats.decide("m", ratio_stats.mean_interval(  # noqa: E731
        pairs_with_sd(n, sd), ratio_stats.VERDICT_CONFIDENCE), 0.1).status
    assert decide(needed) == ratio_stats.OK
    assert needed == ratio_stats.MIN_TRIALS or decide(needed - 1) == ratio_stats.INCONCLUSIVE


def test_noise_reports_each_metric_and_says_never_for_noise_no_count_can_resolve():
    report = noise({"a": pairs_with_sd(12, 0.09), "b": pairs_with_sd(12, 50.0)}, 0.1)
    assert report["a"]["sd"] == pytest.approx(0.09) and report["a"]["mean"] == pytest.approx(0, abs=1e-12)
    assert report["a"]["needed"] == pairs_needed(0.09, 0.1)
    assert report["b"]["needed"] == NO_DECISION


def test_pair_log_ratios_read_ab_trials_records_as_candidate_over_baseline_cost():
    """A candidate 10% slower in decode and TTFT gives +log(1.1) on both, whichever side ran first."""
    from bench.perf_noise import pair_log_ratios

    trials = [{"pair": 0, "side": "baseline", "figures": {"decode_tok_s@8": 110.0, "ttft_s@4rps": 1.0}},
              {"pair": 0, "side": "candidate", "figures": {"decode_tok_s@8": 100.0, "ttft_s@4rps": 1.1}},
              {"pair": 1, "side": "candidate", "figures": {"decode_tok_s@8": 50.0, "ttft_s@4rps": 2.2}},
              {"pair": 1, "side": "baseline", "figures": {"decode_tok_s@8": 55.0, "ttft_s@4rps": 2.0}}]
    ratios = pair_log_ratios(trials, ["decode_tok_s@8", "ttft_s@4rps"])
    assert all(r == pytest.approx([math.log(1.1)] * 2) for r in ratios.values())
