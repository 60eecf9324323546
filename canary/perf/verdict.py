"""Performance figures: latency percentiles (TTFT, TPOT, ITL), the step-time fit `step = a + b*bs`,
bucket-cliff detection over a concurrency sweep, and the stored baselines' files. The regression
verdict itself is canary/perf/trials.py (repeated trials, an interval on the ratio).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path


def percentile(values: Iterable[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]); NaN for no data."""
    data = sorted(values)
    if not data:
        return math.nan
    pos = (len(data) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def summarize(values: Iterable[float]) -> dict[str, float]:
    data = list(values)
    return {"p50": percentile(data, 50), "p90": percentile(data, 90), "p99": percentile(data, 99),
            "mean": sum(data) / len(data) if data else math.nan, "count": len(data)}


@dataclass(frozen=True)
class LinearFit:
    a: float  # fixed cost per step (s)
    b: float  # marginal cost per request in the batch (s)
    r2: float


def fit_step_time(batch_sizes: list[float], step_times: list[float]) -> LinearFit:
    """Least-squares fit of step time against batch size."""
    if len(batch_sizes) != len(step_times) or len(batch_sizes) < 2:
        raise ValueError("need at least two (batch size, step time) points")
    n = len(batch_sizes)
    mx, my = sum(batch_sizes) / n, sum(step_times) / n
    sxx = sum((x - mx) ** 2 for x in batch_sizes)
    if sxx == 0:
        raise ValueError("batch sizes must not all be equal")
    sxy = sum((x - mx) * (y - my) for x, y in zip(batch_sizes, step_times))
    b = sxy / sxx
    a = my - b * mx
    ss_tot = sum((y - my) ** 2 for y in step_times)
    ss_res = sum((y - (a + b * x)) ** 2 for x, y in zip(batch_sizes, step_times))
    return LinearFit(a, b, 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0)


def sweep_levels(max_level: int, buckets: Iterable[int] = ()) -> list[int]:
    """Concurrency levels 1, 2, 4, ... up to `max_level`, plus each graph bucket b and b + 1: a
    bucket cliff lives between two adjacent levels (the seeds': 726 -> 663 tok/s at 56 -> 57), which
    powers of two alone never both land on."""
    levels = {max_level}
    c = 1
    while c < max_level:
        levels.add(c)
        c *= 2
    levels |= {level for b in buckets for level in (b, b + 1) if 1 <= level <= max_level}
    return sorted(levels)


def find_cliffs(levels: list[int], throughput: list[float], drop: float = 0.05) -> list[dict]:
    """Concurrency levels where throughput falls by more than `drop` (fraction) while the load grows:
    the sawtooth that padding to CUDA-graph buckets produces."""
    cliffs = []
    for i in range(1, len(levels)):
        if levels[i] > levels[i - 1] and throughput[i] < throughput[i - 1] * (1 - drop):
            cliffs.append({"from": levels[i - 1], "to": levels[i], "before": throughput[i - 1],
                           "after": throughput[i], "drop": 1 - throughput[i] / throughput[i - 1]})
    return cliffs


def load_baseline(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def save_trials_baseline(path: Path, fingerprint: dict, record: dict) -> None:
    """A trials baseline (canary/perf/trials.py `record_trials`): the trials with their probes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"fingerprint": fingerprint, **record}, indent=2, sort_keys=True) + "\n")
