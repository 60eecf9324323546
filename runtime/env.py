"""Every environment knob of the runtime, typed, in one place, with one prefix (DSV4_).

Modules read knobs through `Env.load()` instead of os.environ so that a reader can find every
switch here and a test can build an `Env` explicitly without touching the process environment.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

PREFIX = "DSV4_"


def _bool(value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected a boolean, got {value!r}")


def _names(value: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in value.split(",") if part.strip())


@dataclass(frozen=True)
class Env:
    # Comma-separated fault names switched on for this process (runtime/faults.py).
    faults: tuple[str, ...] = field(default_factory=tuple)
    # Extra latency added to every engine step by the `slow-step` fault, in milliseconds.
    slow_step_ms: float = 50.0
    # The same delay as a percentage of each step's own time instead (0 = use slow_step_ms).
    slow_step_pct: float = 0.0
    # Force the plain torch reference kernels instead of the fast path (debugging aid).
    reference_kernels: bool = False
    # Torch intra-op threads for the CPU engine; 0 keeps torch's default.
    num_threads: int = 0
    # Tensor parallel: all-gather a digest of every rank's plan each step (DesyncError on mismatch).
    tp_check: bool = False
    # Tensor parallel: a step collective that takes longer than this raises (a stuck peer).
    tp_timeout_s: float = 60.0
    # Tensor parallel: how long the watchdog waits past the timeout before killing a stuck rank.
    tp_watchdog_grace_s: float = 10.0
    # Tensor parallel: rendezvous + model loading on the workers.
    tp_startup_timeout_s: float = 300.0
    # Server: largest request body accepted, in bytes (a larger one gets a 413).
    server_max_body_bytes: int = 4 * 1024 * 1024
    # Server: generation requests in flight at once (one more gets a 429 with Retry-After). Far
    # above the canary gate's 80 sessions: the limit guards memory, not throughput.
    server_max_concurrent: int = 512
    # Server: the API key when --api-key is not given (an argument is visible to every local user
    # in the process list; the environment is not). Kept out of repr so a logged Env cannot leak it.
    server_api_key: str | None = field(default=None, repr=False)
    # Fraction of tool calls whose arguments the `tool-json-corrupt` fault corrupts.
    tool_corrupt_rate: float = 0.1
    # CUDA-graph batch-size buckets, comma-separated (empty: runtime/graph/runner.py FINE_BUCKETS).
    graph_buckets: tuple[int, ...] = field(default_factory=tuple)
    # GPU: random busy-waits of up to this many cycles at every stream event record and wait (0 =
    # off), also inside graph capture, so a missing join becomes a visible race (a debug aid in
    # the spirit of SGLang's cache_consistency_jitter; the canary turns it on to hunt races).
    stream_jitter_cycles: int = 0

    @classmethod
    def load(cls, environ: Mapping[str, str] | None = None) -> Env:
        source: Mapping[str, str] = os.environ if environ is None else environ

        def get(name: str) -> str | None:
            return source.get(PREFIX + name)

        kwargs: dict = {}
        if (value := get("FAULTS")) is not None:
            kwargs["faults"] = _names(value)
        if (value := get("SLOW_STEP_MS")) is not None:
            kwargs["slow_step_ms"] = float(value)
        if (value := get("SLOW_STEP_PCT")) is not None:
            kwargs["slow_step_pct"] = float(value)
        if (value := get("REFERENCE_KERNELS")) is not None:
            kwargs["reference_kernels"] = _bool(value)
        if (value := get("NUM_THREADS")) is not None:
            kwargs["num_threads"] = int(value)
        if (value := get("TP_CHECK")) is not None:
            kwargs["tp_check"] = _bool(value)
        for knob in ("tp_timeout_s", "tp_watchdog_grace_s", "tp_startup_timeout_s"):
            if (value := get(knob.upper())) is not None:
                kwargs[knob] = float(value)
        if (value := get("SERVER_MAX_BODY_BYTES")) is not None:
            kwargs["server_max_body_bytes"] = int(value)
        if (value := get("SERVER_MAX_CONCURRENT")) is not None:
            kwargs["server_max_concurrent"] = int(value)
        if value := get("SERVER_API_KEY"):
            kwargs["server_api_key"] = value
        if (value := get("TOOL_CORRUPT_RATE")) is not None:
            kwargs["tool_corrupt_rate"] = float(value)
        if (value := get("GRAPH_BUCKETS")) is not None:
            kwargs["graph_buckets"] = tuple(int(part) for part in _names(value))
        if (value := get("STREAM_JITTER_CYCLES")) is not None:
            kwargs["stream_jitter_cycles"] = int(value)
        return cls(**kwargs)
