"""The gate's command-line options as one value (`CanaryOptions`, filled by canary/pytest_plugin.py)
and what they mean for the session driver. Kept apart from the plugin so the gate and the tests use
them without importing pytest hooks, and light (no HTTP client, no torch) so `pytest --help` stays fast.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from canary.oracles.differential import DEFAULT_SAMPLE  # stdlib imports only
from canary.perf.ratio_stats import MIN_TRIALS_DEFAULT  # stdlib only too


@dataclass(frozen=True)
class CanaryOptions:
    sessions: int
    turns: int | None
    concurrency: int | None
    base_url: str | None
    model: str | None
    api_key: str | None
    stream_ratio: float
    abort_ratio: float
    faults: tuple[str, ...]
    baseline: Path | None
    baseline_url: str | None
    perf_tolerance: float
    report_dir: Path | None
    golden_update: bool
    baseline_update: bool
    sweep: bool
    max_tokens: int
    processes: int = 1  # driver processes (DriverOptions.processes)
    differential_sample: int = DEFAULT_SAMPLE
    deterministic: bool | None = None  # None: exact for the embedded runtime only (canary/gate.py run_gate)
    perf_trials: int = MIN_TRIALS_DEFAULT  # perf verdict: trials (A/B: pairs) before the first look
    # The workload mix (canary/workload.py); 0 here, the gate's defaults come from the plugin.
    sampled_ratio: float = 0.0
    stop_ratio: float = 0.0
    multibyte_ratio: float = 0.0
    small_pool_pages: int = 0  # the small-pool run's KV pages; 0: no small-pool run
    calibrate: bool | None = None  # sessions alone first (canary/calibration.py); None: for plain-words targets
    # The perf trials' workload, what differs from canary/gate.py PERF_WORKLOAD (TrialWorkload.describe() keys)
    perf_workload: dict[str, Any] | None = None


def serves_canary_model(model: str | None) -> bool:
    """A remote target serving a canary-* model (a staging deployment of this runtime) gets the
    exact prompts the canary model was trained on; any other model gets plain-words prompts."""
    return model is not None and Path(model).name.startswith("canary-")


def driver_options(options: CanaryOptions, target=None, **overrides):
    from canary.driver import DriverOptions

    generic = options.base_url is not None and not serves_canary_model(target.model if target else options.model)
    values: dict[str, Any] = dict(sessions=options.sessions, concurrency=options.concurrency, turns=options.turns,
                  stream_ratio=options.stream_ratio, abort_ratio=options.abort_ratio, max_tokens=options.max_tokens,
                  generic_prompts=generic, processes=options.processes, sampled_ratio=options.sampled_ratio,
                  stop_ratio=options.stop_ratio, multibyte_ratio=options.multibyte_ratio)
    values.update(overrides)
    return DriverOptions(**values)
