"""How noisy the perf trials are on this machine: two clean servers of one build, a fixed number of A/B
pairs (canary/perf/trials.py's pairs, in the gate's order), and per metric the sd of a pair's log
ratio, the wall time of a pair, and the pairs a verdict would need to decide at that noise.

A verdict decides a clean run once the upper bound of its interval is under log(1 + tolerance)
(canary/perf/ratio_stats.py), i.e. once t(1 - alpha, n - 1) * sd / sqrt(n) < log(1 + tolerance) with
the mean near 0; `needed` is that n (more than the verdict's cap: it cannot decide here). Run this
before `bench.perf_verdict_trials` (tens of minutes on the 2-core CPU) to pick a trial workload this
machine can judge at 10%:

    python -m bench.perf_noise --pairs 12                                              # 2-core CPU
    python -m bench.perf_noise --pairs 12 --perf-workload '{"ttft_rate": 1, "rounds": 3}'
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from contextlib import ExitStack

from bench.perf_verdict_trials import workload_arg
from canary.perf import ratio_stats
from canary.perf.trial_load import WORKLOAD_KEYS, TrialWorkload
from canary.perf.trials import MAX_TRIALS_FACTOR, MIN_TRIALS_DEFAULT, ab_trials, log_cost
from canary.provenance import device_name, git_commit
from canary.targets import embedded_server
from runtime.config import DEFAULT_MODEL

NO_DECISION = 10_000  # `needed` when no pair count up to this would decide


def pairs_needed(sd: float, tolerance: float, alpha: float = ratio_stats.ONE_SIDED_ALPHA) -> int:
    """The fewest pairs whose one-sided bound at `alpha` lies within log(1 + tolerance) of a mean of 0."""
    limit = math.log1p(tolerance)
    # t's quantile is above the normal's, so no n below (z * sd / limit)^2 can do: start there.
    z = statistics.NormalDist().inv_cdf(1 - alpha)
    start = max(ratio_stats.MIN_TRIALS, math.floor((z * sd / limit) ** 2))
    for n in range(start, NO_DECISION):
        if ratio_stats.t_quantile(1 - alpha, n - 1) * sd / math.sqrt(n) < limit:
            return n
    return NO_DECISION


def pair_log_ratios(trials: list[dict], metrics: list[str]) -> dict[str, list[float]]:
    """Per metric, each A/B pair's log cost ratio (candidate over baseline) from `ab_trials`' records."""
    sides: dict[int, dict[str, dict]] = {}
    for t in trials:
        sides.setdefault(t["pair"], {})[t["side"]] = t["figures"]
    return {m: [log_cost(m, s["candidate"][m]) - log_cost(m, s["baseline"][m]) for _, s in sorted(sides.items())]
            for m in metrics}


def noise(log_ratios: dict[str, list[float]], tolerance: float) -> dict[str, dict]:
    """Per metric: the pairs' mean log ratio, its sd, and the pairs a verdict needs at that sd."""
    out = {}
    for metric, ratios in log_ratios.items():
        sd = statistics.stdev(ratios)
        out[metric] = {"mean": statistics.fmean(ratios), "sd": sd, "needed": pairs_needed(sd, tolerance)}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=12)
    parser.add_argument("--tolerance", type=float, default=0.1)
    parser.add_argument("--perf-workload", type=workload_arg, default=TrialWorkload(), metavar="JSON",
                        help=f"changes to the default trial workload (keys: {', '.join(WORKLOAD_KEYS)})")
    parser.add_argument("--server-arg", action="append", default=[], help="extra runtime.serve argument")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--out", default=None, help="the report as JSON")
    args = parser.parse_args(argv)
    if args.pairs < 3:
        parser.error("--pairs must be at least 3 (an sd needs a few pairs)")
    workload: TrialWorkload = args.perf_workload
    commit = git_commit()  # once: with files that differ from HEAD it hashes their tree
    print(f"perf noise on {device_name()} at {commit}: {args.pairs} pairs of two clean servers, "
          f"workload {workload.describe()}", flush=True)
    with ExitStack() as stack:
        a, b = (stack.enter_context(embedded_server(args.model, args.server_arg)) for _ in range(2))
        started = time.monotonic()
        # The gate's own A/B pairs (warm-up, order A B, B A, ...), exactly `--pairs` of them.
        outcome = ab_trials(b, a, workload, args.tolerance, min_pairs=args.pairs, max_pairs=args.pairs,
                            on_trial=lambda t: print(f"  pair {t['pair']} {t['side']}: {t['figures']}", flush=True))
        seconds = (time.monotonic() - started) / (args.pairs + 1)  # the warm-up pair included
    log_ratios = pair_log_ratios(outcome.trials, workload.metrics())
    cap = MAX_TRIALS_FACTOR * MIN_TRIALS_DEFAULT
    report = {"device": device_name(), "commit": commit, "workload": workload.describe(),
              "pairs": args.pairs, "pair_seconds": seconds,
              "metrics": noise(log_ratios, args.tolerance)}
    print(f"a pair takes {report['pair_seconds']:.1f} s; a verdict takes at most {cap} pairs")
    for metric, m in report["metrics"].items():
        needed = "never" if m["needed"] >= NO_DECISION else str(m["needed"])
        print(f"  {metric}: sd {m['sd']:.3f}, mean {m['mean']:+.3f} -> a clean verdict needs ~{needed} pairs"
              f"{'' if m['needed'] <= cap else ' (over the cap: inconclusive)'}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
