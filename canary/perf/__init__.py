"""Speed: `metrics` (TTFT/TPOT/ITL/tok/s of a run), `trials` (the perf verdict: repeated interleaved
trials of `trial_load`'s fixed workload, an interval on the ratio by `ratio_stats`, against an A/B
baseline server or a stored baseline's trials), `verdict` (percentiles, the step-time fit, bucket
cliffs, baseline files), `machine_speed` (the probe that tells whether a CPU verdict runs on the
recording's machine)."""
