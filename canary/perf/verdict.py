"""Performance figures and the regression gate.

Latency percentiles (TTFT, TPOT, ITL), the step-time fit `step = a + b*bs`, bucket-cliff
detection over a concurrency sweep, and the comparison against a stored baseline.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


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


def find_cliffs(levels: list[int], throughput: list[float], drop: float = 0.05) -> list[dict]:
    """Concurrency levels where throughput falls by more than `drop` (fraction) while the load grows:
    the sawtooth that padding to CUDA-graph buckets produces."""
    cliffs = []
    for i in range(1, len(levels)):
        if levels[i] > levels[i - 1] and throughput[i] < throughput[i - 1] * (1 - drop):
            cliffs.append({"from": levels[i - 1], "to": levels[i], "before": throughput[i - 1],
                           "after": throughput[i], "drop": 1 - throughput[i] / throughput[i - 1]})
    return cliffs


# Higher is better for these figures; lower is better for everything else that is gated.
HIGHER_IS_BETTER = {"output_tok_s"}


@dataclass(frozen=True)
class MetricVerdict:
    """One metric of a run against its baseline (or the A/B baseline server)."""

    metric: str
    baseline: float
    candidate: float
    ratio: float  # candidate / baseline, oriented so that > 1 + tolerance means worse
    passed: bool


def compare_to_baseline(baseline: dict[str, float], candidate: dict[str, float],
                        tolerance: float) -> list[MetricVerdict]:
    """Compare every metric present in both; a metric worse by more than `tolerance` fails."""
    results = []
    for metric in sorted(set(baseline) & set(candidate)):
        base, cand = float(baseline[metric]), float(candidate[metric])
        if not (math.isfinite(base) and math.isfinite(cand)) or base <= 0 or cand <= 0:
            continue
        worse_ratio = base / cand if metric in HIGHER_IS_BETTER else cand / base
        results.append(MetricVerdict(metric, base, cand, worse_ratio, worse_ratio <= 1 + tolerance))
    return results


def load_baseline(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def save_baseline(path: Path, fingerprint: dict, metrics: dict[str, float], machine_speed: float | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    record: dict[str, Any] = {"fingerprint": fingerprint, "metrics": metrics}
    if machine_speed is not None:
        record["machine_speed"] = machine_speed
    path.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")


def scale_for_machine(metrics: dict[str, float], speed_ratio: float) -> dict[str, float]:
    """The baseline's figures as expected on a machine `speed_ratio` times as fast as the recording one
    (canary/perf/machine_speed.py): throughput scales with the speed, latencies with its inverse."""
    if not (math.isfinite(speed_ratio) and speed_ratio > 0):
        raise ValueError(f"machine speed ratio must be a positive number, got {speed_ratio}")
    return {k: v * speed_ratio if k in HIGHER_IS_BETTER else v / speed_ratio for k, v in metrics.items()}


def verdict_report(results: list[MetricVerdict]) -> list[dict]:
    return [asdict(r) for r in results]
